//! Resource limits on what the user's files may make hzp do: a memory budget that declared
//! sizes are checked against before anything is allocated (`--input-budget`; default half of
//! the machine's RAM), and input files that must be regular files (a FIFO or a device
//! would block a read forever or never end).

use std::fs::File;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// 0: not set, use [`default_max_memory`].
static MAX_MEMORY: AtomicU64 = AtomicU64::new(0);

/// The machine's RAM in bytes (Linux: `MemTotal` of `/proc/meminfo`), if known.
pub fn physical_memory() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Half of the machine's RAM, or 4 GiB where that is unknown.
pub fn default_max_memory() -> u64 {
    physical_memory().map_or(4 << 30, |m| m / 2)
}

/// Sets the budget (from `--input-budget`).
pub fn set_max_memory(bytes: u64) {
    MAX_MEMORY.store(bytes.max(1), Ordering::Relaxed);
}

/// The budget in bytes that one file's declared data may take.
pub fn max_memory() -> u64 {
    match MAX_MEMORY.load(Ordering::Relaxed) {
        0 => default_max_memory(),
        n => n,
    }
}

/// Bytes in words: `1.5 GiB`.
pub fn fmt_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = b as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < UNITS.len() {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{x:.1} {}", UNITS[u])
    }
}

/// Checks that `bytes` of data fit the budget; the error says what needs them (`what`), the
/// size, the budget and how to raise it.
pub fn check_budget(what: &str, bytes: u64) -> Result<(), String> {
    let budget = max_memory();
    if bytes <= budget {
        return Ok(());
    }
    Err(format!(
        "{what} needs {} ({bytes} bytes), more than the memory budget of {} (--input-budget; the default is half of this machine's RAM)",
        fmt_bytes(bytes),
        fmt_bytes(budget)
    ))
}

/// Checks every node's results against the memory budget (`--input-budget`) before a
/// program runs on the CPU evaluator, so a node whose result cannot fit (a constant-driven
/// Expand, Tile, OneHot or Concat of a huge shape) is an error naming it, not an aborted
/// allocation.
pub fn check_result_sizes(p: &hzp_ir::Program) -> Result<(), String> {
    for n in &p.nodes {
        for &v in &n.outputs {
            let ty = p.ty(v);
            let bytes = ty
                .shape
                .iter()
                .try_fold(ty.dtype.size_bytes() as u64, |a, &d| {
                    a.checked_mul(d as u64)
                })
                .unwrap_or(u64::MAX);
            check_budget(
                &format!(
                    "node `{}` ({}) makes a result of {} {:?} that",
                    n.name,
                    n.op.name(),
                    ty.dtype,
                    ty.shape
                ),
                bytes,
            )?;
        }
    }
    Ok(())
}

/// What a non-regular file is, in words.
fn kind(m: &std::fs::Metadata) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        let t = m.file_type();
        if t.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if t.is_char_device() || t.is_block_device() {
            return "a device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if m.is_dir() {
        "a folder"
    } else {
        "not a regular file"
    }
}

/// Opens `path` for reading after checking it is a regular file (through symlinks), so a
/// FIFO or a device cannot block the read or feed it forever. The error is an
/// [`io::Error`] whose text says what the path is instead.
pub fn open_regular(path: &Path) -> io::Result<File> {
    let m = std::fs::metadata(path)?;
    if !m.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("it is {}, not a regular file", kind(&m)),
        ));
    }
    let f = File::open(path)?;
    // The path may have been swapped between the two calls: check what was opened.
    if !f.metadata()?.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "it is not a regular file",
        ));
    }
    Ok(f)
}

/// Reads a whole regular file whose size fits the budget.
pub fn read_regular(path: &Path) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let mut f = open_regular(path)?;
    let len = f.metadata()?.len();
    check_budget("the file", len).map_err(io::Error::other)?;
    let mut buf = Vec::new();
    buf.try_reserve(len as usize)
        .map_err(|_| io::Error::other(format!("cannot allocate {} to read it", fmt_bytes(len))))?;
    f.read_to_end(&mut buf)?;
    Ok(buf)
}

/// [`read_regular`] as UTF-8 text.
pub fn read_regular_string(path: &Path) -> io::Result<String> {
    String::from_utf8(read_regular(path)?)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "it is not UTF-8 text"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let d = std::env::temp_dir().join(format!("hzp-limits-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let fifo = d.join("data.bin");
        let ok = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("skipping: mkfifo is not available");
            return;
        }
        let e = open_regular(&fifo).unwrap_err().to_string();
        assert!(e.contains("FIFO"), "{e}");
        let e = read_regular(&d).unwrap_err().to_string();
        assert!(e.contains("folder"), "{e}");
    }

    #[test]
    fn budget_messages_name_the_sizes() {
        assert!(check_budget("x", 10).is_ok());
        let e = check_budget("array `a`", u64::MAX).unwrap_err();
        assert!(
            e.contains("array `a` needs") && e.contains("--input-budget"),
            "{e}"
        );
        assert_eq!(fmt_bytes(3 << 30), "3.0 GiB");
    }
}
