//! Printing that reports failures instead of panicking: `println!` panics when stdout cannot
//! be written (a full disk, `> /dev/full`), which would exit with code 101. `outln!` and
//! `out!` return an error naming stdout; `note!` writes to stderr and ignores failure
//! (there is nowhere left to report it).

use std::fmt::Arguments;
use std::io::Write;

/// Set in the processes of a multi-process run other than rank 0's: their stdout says
/// nothing (rank 0 prints the run's report; errors and notes still go to stderr).
static QUIET: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// From now on `out` writes nothing (see [`QUIET`]).
pub fn quiet() {
    QUIET.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Writes formatted text to stdout.
pub fn out(args: Arguments<'_>) -> miette::Result<()> {
    if QUIET.load(std::sync::atomic::Ordering::Relaxed) {
        return Ok(());
    }
    let mut o = std::io::stdout().lock();
    o.write_fmt(args)
        .map_err(|e| miette::miette!("cannot write to stdout: {e}"))
}

/// Flushes stdout (what `print!` left in its buffer), reporting failure.
pub fn flush() -> miette::Result<()> {
    std::io::stdout()
        .flush()
        .map_err(|e| miette::miette!("cannot write to stdout: {e}"))
}

/// Writes formatted text to stderr; a failure is ignored.
pub fn note(args: Arguments<'_>) {
    let _ = std::io::stderr().lock().write_fmt(args);
}

/// `println!` that returns (with `?`) an error when stdout cannot be written.
macro_rules! outln {
    () => {
        $crate::stdio::out(format_args!("\n"))?
    };
    ($($t:tt)*) => {
        $crate::stdio::out(format_args!("{}\n", format_args!($($t)*)))?
    };
}

/// `print!` that returns (with `?`) an error when stdout cannot be written.
macro_rules! out {
    ($($t:tt)*) => {
        $crate::stdio::out(format_args!($($t)*))?
    };
}

/// `eprintln!` that never panics.
macro_rules! note {
    ($($t:tt)*) => {
        $crate::stdio::note(format_args!("{}\n", format_args!($($t)*)))
    };
}
