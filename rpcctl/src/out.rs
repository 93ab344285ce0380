//! Standard output for scripts: a reader that goes away (`rpcctl ... | head`) ends the command
//! quietly with exit code 0, as it does for `events`, instead of the panic (exit code 101)
//! that `println!` turns a closed pipe into.

use std::io::Write;

/// Writes `text` to standard output. A closed pipe ends the process with exit code 0 (the
/// reader has all it wanted); another failure to write (a full disk) with exit code 1.
pub fn write(text: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    match out.write_fmt(text).and_then(|()| out.flush()) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => {
            eprintln!("rpcctl: cannot write to standard output: {e}");
            std::process::exit(1)
        }
    }
}

/// `print!` through [`write()`].
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::out::write(format_args!($($arg)*))
    };
}

/// `println!` through [`write()`].
macro_rules! outln {
    () => {
        $crate::out::write(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::out::write(format_args!("{}\n", format_args!($($arg)*)))
    };
}

pub(crate) use {out, outln};
