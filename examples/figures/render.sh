#!/usr/bin/env bash
# Screenshots SVG files in headless Chromium, to check that they render and to get PNGs.
#
#   examples/figures/render.sh [FILE.svg ...]     (default: every SVG beside this script)
#
# Each FILE.svg gives FILE.png in $RENDER_OUT (default: a new temporary folder). The script
# fails if Chromium is missing, if a screenshot is not written, or if it is blank. Install Chromium with
# `apt-get install -y chromium` (Debian) or point $CHROMIUM at a Chrome/Chromium binary.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
browser="${CHROMIUM:-}"
if [ -z "$browser" ]; then
  for b in chromium chromium-browser google-chrome; do
    if command -v "$b" >/dev/null 2>&1; then browser="$b"; break; fi
  done
fi
if [ -z "$browser" ]; then
  echo "render.sh: no Chromium found (apt-get install -y chromium, or set CHROMIUM)" >&2
  exit 2
fi
if [ "$#" -eq 0 ]; then
  set -- "$here"/*.svg
fi
out="${RENDER_OUT:-$(mktemp -d)}"
mkdir -p "$out"
status=0
for svg in "$@"; do
  svg="$(cd "$(dirname "$svg")" && pwd)/$(basename "$svg")"
  png="$out/$(basename "${svg%.svg}").png"
  # The size of the picture, from the root element's width and height.
  w="$(grep -o -m1 '<svg[^>]*width="[0-9.]*"' "$svg" | sed 's/.*width="\([0-9.]*\)"/\1/')"
  h="$(grep -o -m1 '<svg[^>]*height="[0-9.]*"' "$svg" | sed 's/.*height="\([0-9.]*\)"/\1/')"
  rm -f "$png"
  "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars \
    --window-size="${w%.*},${h%.*}" --screenshot="$png" "file://$svg" >/dev/null 2>&1 || true
  if [ ! -s "$png" ]; then
    echo "render.sh: $svg: no screenshot written" >&2
    status=1
    continue
  fi
  # A blank render (e.g. an XML error page is not blank, but an empty SVG is) has one colour.
  if command -v python3 >/dev/null 2>&1; then
    colours="$(python3 - "$png" <<'PY'
import sys, zlib, struct
data = open(sys.argv[1], 'rb').read()
# Count distinct bytes of the decompressed image data: 1 means a blank picture.
chunks, i = [], 8
while i < len(data):
    n = struct.unpack('>I', data[i:i+4])[0]
    if data[i+4:i+8] == b'IDAT':
        chunks.append(data[i+8:i+8+n])
    i += 12 + n
print(len(set(zlib.decompress(b''.join(chunks)))))
PY
)"
    if [ "$colours" -le 2 ]; then
      echo "render.sh: $svg rendered blank" >&2
      status=1
      continue
    fi
  fi
  echo "rendered $svg -> $png (${w}x${h})"
done
exit $status
