//! Writing the user's output files safely: the one function every command that writes a
//! file goes through ([`write_with`], [`write_bytes`]).
//!
//! - The target must be a regular file or not exist yet: a device node (`/dev/full`,
//!   `/dev/null`), a FIFO, a socket or a directory is refused before anything is written
//!   (renaming over one would replace it with a regular file). To write to stdout, leave out
//!   the output flag.
//! - An existing file without write permission is refused, not replaced.
//! - The data goes to a temporary file in the target's folder, created exclusively
//!   (`O_CREAT | O_EXCL`, which never follows a symlink planted at its name) under a name
//!   with 64 random bits, then is flushed to disk (`fsync`) and renamed over the target, so
//!   a failure never leaves a half-written file at the user's path. On any failure the
//!   temporary file is removed.
//! - Every error names the user's file.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::hash::{BuildHasher, Hasher};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

/// A file that could not be written, in the user's terms.
#[derive(Debug)]
pub struct WriteError {
    /// The target as the user named it.
    pub path: PathBuf,
    pub message: String,
}

impl fmt::Display for WriteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cannot write {}: {}", self.path.display(), self.message)
    }
}

impl std::error::Error for WriteError {}

fn err(path: &Path, message: impl Into<String>) -> WriteError {
    WriteError {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// What kind of non-regular file `ft` is, in words.
fn kind_of(ft: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if ft.is_char_device() {
            return "a character device";
        }
        if ft.is_block_device() {
            return "a block device";
        }
        if ft.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if ft.is_socket() {
            return "a socket";
        }
    }
    if ft.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

/// Checks that `path` may be replaced: it is absent, or a regular file (through a symlink
/// too: the link itself is what gets replaced) that its owner may write.
pub fn check_target(path: &Path) -> Result<(), WriteError> {
    if path.as_os_str().is_empty() {
        return Err(err(path, "the file name is empty"));
    }
    match std::fs::metadata(path) {
        Ok(m) => {
            let ft = m.file_type();
            if !ft.is_file() {
                return Err(err(
                    path,
                    format!(
                        "it is {}; hzp writes only regular files (leave out the output flag to print to stdout where the command can)",
                        kind_of(&ft)
                    ),
                ));
            }
            if m.permissions().readonly() {
                return Err(err(
                    path,
                    "it exists and is read-only; refusing to replace it (make it writable or choose another name)",
                ));
            }
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            // A dangling symlink: renaming would replace the link; its target stays as it is.
            Ok(())
        }
        Err(e) => Err(err(path, e.to_string())),
    }
}

/// 64 bits that another process cannot guess: std's `RandomState` is seeded from the OS's
/// random source, mixed with the time, the process id and a counter.
fn random_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    if let Ok(d) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(d.as_nanos());
    }
    h.finish()
}

/// Creates a fresh temporary file beside `path`, exclusively.
fn create_temp(path: &Path) -> Result<(PathBuf, File), WriteError> {
    let fname = path
        .file_name()
        .ok_or_else(|| err(path, "it is not a file name (it names a folder)"))?
        .to_string_lossy()
        .into_owned();
    let mut last = None;
    for _ in 0..16 {
        let tmp = path.with_file_name(format!(".{fname}.{:016x}.tmp", random_suffix()));
        let mut o = OpenOptions::new();
        o.write(true).create_new(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            o.mode(0o644);
        }
        match o.open(&tmp) {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => {
                return Err(err(
                    path,
                    format!(
                        "cannot create a temporary file in its folder ({}): {e}",
                        tmp.parent()
                            .filter(|p| !p.as_os_str().is_empty())
                            .unwrap_or(Path::new("."))
                            .display()
                    ),
                ))
            }
        }
    }
    Err(err(
        path,
        format!(
            "cannot create a temporary file in its folder: {}",
            last.map_or_else(|| "names taken".to_string(), |e| e.to_string())
        ),
    ))
}

/// Writes `path` with what `fill` writes: checked target, exclusive temporary file, fsync,
/// rename; the temporary file is removed on any failure and the target left as it was.
pub fn write_with(
    path: &Path,
    fill: impl FnOnce(&mut BufWriter<File>) -> io::Result<()>,
) -> Result<(), WriteError> {
    check_target(path)?;
    let (tmp, file) = create_temp(path)?;
    let result = (|| -> Result<(), WriteError> {
        let mut w = BufWriter::with_capacity(1 << 20, file);
        fill(&mut w).map_err(|e| err(path, e.to_string()))?;
        let file = w
            .into_inner()
            .map_err(|e| err(path, e.error().to_string()))?;
        // Keep the permissions of the file being replaced.
        if let Ok(m) = std::fs::metadata(path) {
            let _ = file.set_permissions(m.permissions());
        }
        file.sync_all().map_err(|e| err(path, e.to_string()))?;
        drop(file);
        // The target may have changed into something else since the check.
        check_target(path)?;
        std::fs::rename(&tmp, path)
            .map_err(|e| err(path, format!("cannot replace it with the new file: {e}")))?;
        #[cfg(unix)]
        if let Some(dir) = path.parent() {
            let dir = if dir.as_os_str().is_empty() {
                Path::new(".")
            } else {
                dir
            };
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Writes `bytes` to `path` (see [`write_with`]).
pub fn write_bytes(path: &Path, bytes: &[u8]) -> Result<(), WriteError> {
    write_with(path, |w| w.write_all(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("hzp-output-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn leftovers(d: &Path) -> Vec<String> {
        std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp"))
            .collect()
    }

    #[test]
    fn writes_and_replaces_a_regular_file() {
        let d = tmpdir("regular");
        let p = d.join("out.txt");
        write_bytes(&p, b"one").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"one");
        write_bytes(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert!(leftovers(&d).is_empty());
    }

    #[test]
    fn refuses_a_directory_and_a_fifo() {
        let d = tmpdir("fifo");
        let e = write_bytes(&d, b"x").unwrap_err().to_string();
        assert!(e.contains("a directory"), "{e}");
        let fifo = d.join("pipe");
        // A FIFO from mkfifo(1): no libc dependency here.
        let ok = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("skipping the FIFO case: mkfifo is not available");
            return;
        }
        let e = write_bytes(&fifo, b"x").unwrap_err().to_string();
        assert!(e.contains("FIFO") && e.contains("pipe"), "{e}");
        use std::os::unix::fs::FileTypeExt;
        assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
        assert!(leftovers(&d).is_empty());
    }

    #[test]
    fn refuses_a_device_node() {
        let e = write_bytes(Path::new("/dev/null"), b"x")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/dev/null") && e.contains("character device"),
            "{e}"
        );
        use std::os::unix::fs::FileTypeExt;
        assert!(std::fs::metadata("/dev/null")
            .unwrap()
            .file_type()
            .is_char_device());
    }

    #[test]
    fn keeps_a_read_only_file() {
        let d = tmpdir("ro");
        let p = d.join("keep.npz");
        std::fs::write(&p, b"precious").unwrap();
        let mut perm = std::fs::metadata(&p).unwrap().permissions();
        perm.set_readonly(true);
        std::fs::set_permissions(&p, perm).unwrap();
        let e = write_bytes(&p, b"new").unwrap_err().to_string();
        assert!(e.contains("read-only") && e.contains("keep.npz"), "{e}");
        assert_eq!(std::fs::read(&p).unwrap(), b"precious");
    }

    #[test]
    fn a_symlink_planted_at_a_temporary_name_is_not_followed() {
        let d = tmpdir("symlink");
        let victim = d.join("victim");
        std::fs::write(&victim, b"victim").unwrap();
        let target = d.join("out.json");
        // Plant links at the old predictable names and at many guesses of the new form; the
        // writer must create its own file, never open through a link.
        for name in ["out.json.tmp", "out.tmp", ".out.json.tmp"] {
            std::os::unix::fs::symlink(&victim, d.join(name)).unwrap();
        }
        write_bytes(&target, b"plan").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"victim");
        assert_eq!(std::fs::read(&target).unwrap(), b"plan");
        // The exclusive create itself refuses a link at the chosen name.
        let link = d.join("link.tmp");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let e = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&link)
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&victim).unwrap(), b"victim");
    }

    #[test]
    fn temporary_names_differ() {
        let a = random_suffix();
        let b = random_suffix();
        assert_ne!(a, b);
    }

    #[test]
    fn a_failing_writer_leaves_the_old_file_and_no_temporary() {
        let d = tmpdir("fail");
        let p = d.join("out.bin");
        std::fs::write(&p, b"old").unwrap();
        let e = write_with(&p, |w| {
            w.write_all(b"partial")?;
            Err(io::Error::other("disk on fire"))
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("out.bin") && e.contains("disk on fire"), "{e}");
        assert_eq!(std::fs::read(&p).unwrap(), b"old");
        assert!(leftovers(&d).is_empty());
    }

    #[test]
    fn a_missing_folder_is_named() {
        let e = write_bytes(Path::new("/nonexistent-hzp-dir/out.npz"), b"x")
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent-hzp-dir/out.npz"), "{e}");
    }
}
