//! Paths in the commands the supervisor prints for a user to paste (`--resume RUN_DIR`,
//! `export RUN_DIR`): quoted for a POSIX shell when they hold anything but plain
//! characters, so a run directory with a space, a quote or a newline pastes as itself.

use std::path::Path;

/// `path` as one word of a POSIX shell command line.
pub fn quote(path: &Path) -> String {
    let s = path.to_string_lossy();
    let plain = !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_./:@%+=,-".contains(&b));
    if plain {
        return s.into_owned();
    }
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_pastes_back_as_itself() {
        assert_eq!(quote(Path::new("/runs/a-1.x")), "/runs/a-1.x");
        assert_eq!(quote(Path::new("/my runs/a")), "'/my runs/a'");
        assert_eq!(quote(Path::new("it's")), r"'it'\''s'");
        assert_eq!(quote(Path::new("a\nb")), "'a\nb'");
        assert_eq!(quote(Path::new("$HOME")), "'$HOME'");
        // What sh makes of the quoted word is the path itself.
        for p in ["/my runs/a", "it's", "a\nb", "$HOME`x`", "*"] {
            let out = std::process::Command::new("sh")
                .arg("-c")
                .arg(format!("printf %s {}", quote(Path::new(p))))
                .output()
                .unwrap();
            assert_eq!(String::from_utf8_lossy(&out.stdout), p);
        }
    }
}
