//! What the supervisor reads of a `dflash-worker` tool's output.

/// The one-line error a `dflash-worker` tool printed: the last non-blank line of its
/// standard error, without the "dflash-worker: error: " its messages start with.
pub fn error_line(stderr: &[u8]) -> String {
    let err = String::from_utf8_lossy(stderr);
    let line = err
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("no message")
        .trim();
    line.strip_prefix("dflash-worker: error: ")
        .unwrap_or(line)
        .to_string()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_last_non_blank_line_without_the_workers_prefix() {
        let err = b"loading...\ndflash-worker: error: drafter/config.json: no such file\n\n";
        assert_eq!(super::error_line(err), "drafter/config.json: no such file");
        assert_eq!(super::error_line(b"  \n"), "no message");
    }
}
