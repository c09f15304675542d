//! Checkpoint integrity: `meta.json` of a checkpoint records a checksum of each file it
//! covers, and a checkpoint is trusted only when every file still matches and every
//! stored value (parameters, Adam moments) is finite. Both the worker (before it loads one)
//! and the supervisor (before it picks one to resume or roll back to) check.

use std::path::Path;

/// The tensors of a checkpoint: parameters and Adam moments (f32).
pub const STATE_FILE: &str = "state.safetensors";
pub const META_FILE: &str = "meta.json";

/// The step of a checkpoint directory named `step-N` (zero-padded); `None` for anything
/// else, such as the temporary `step-N.tmp-PID` of a checkpoint being written.
pub fn step_of_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The checksum meta.json records for a file's bytes (hex).
pub fn checksum_hex(bytes: &[u8]) -> String {
    format!("{:016x}", crate::batch::checksum(bytes))
}

/// Verify the checkpoint in `dir`; returns its step. Errors are one line naming the file.
pub fn verify(dir: &Path) -> Result<u64, String> {
    let meta_path = dir.join(META_FILE);
    let text =
        std::fs::read_to_string(&meta_path).map_err(|e| format!("{}: {e}", meta_path.display()))?;
    let meta: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| format!("{}: not valid JSON: {e}", meta_path.display()))?;
    let step = meta["step"]
        .as_u64()
        .ok_or_else(|| format!("{}: no step", meta_path.display()))?;
    let path = dir.join(STATE_FILE);
    let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    // A checkpoint written before checksums were recorded has none: the finiteness check
    // still applies.
    if let Some(want) = meta["checksums"][STATE_FILE].as_str() {
        let got = checksum_hex(&bytes);
        if got != want {
            return Err(format!(
                "{}: checksum {got}, meta.json says {want} (the file changed after it was written)",
                path.display()
            ));
        }
    }
    check_finite_f32(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(step)
}

/// Every value of a safetensors file whose tensors are all f32 is finite.
fn check_finite_f32(bytes: &[u8]) -> Result<(), String> {
    let n = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
        .ok_or("truncated (no header)")?;
    let end = n.checked_add(8).ok_or("header length out of range")?;
    let header = bytes.get(8..end).ok_or("truncated (header)")?;
    let h: serde_json::Value =
        serde_json::from_slice(header).map_err(|e| format!("header is not JSON: {e}"))?;
    let data = &bytes[end..];
    for (name, t) in h
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(k, _)| *k != "__metadata__")
    {
        if t["dtype"] != "F32" {
            return Err(format!("tensor {name} is {}, expected F32", t["dtype"]));
        }
        let off = &t["data_offsets"];
        let (a, b) = (
            off[0].as_u64().unwrap_or(u64::MAX) as usize,
            off[1].as_u64().unwrap_or(0) as usize,
        );
        let region = data.get(a..b).filter(|r| r.len() % 4 == 0).ok_or_else(|| {
            format!("tensor {name}: data offsets {a}..{b} outside the file (truncated?)")
        })?;
        if let Some(i) = region
            .chunks_exact(4)
            .position(|c| !f32::from_le_bytes(c.try_into().expect("4 bytes")).is_finite())
        {
            return Err(format!(
                "tensor {name} holds a non-finite value (element {i})"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, values: &[f32], meta_checksum: bool) {
        let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let header = format!(
            r#"{{"params":{{"dtype":"F32","shape":[{}],"data_offsets":[0,{}]}}}}"#,
            values.len(),
            data.len()
        );
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend(header.as_bytes());
        bytes.extend(&data);
        std::fs::write(dir.join(STATE_FILE), &bytes).unwrap();
        let sums = if meta_checksum {
            serde_json::json!({STATE_FILE: checksum_hex(&bytes)})
        } else {
            serde_json::Value::Null
        };
        std::fs::write(
            dir.join(META_FILE),
            serde_json::json!({"step": 7, "checksums": sums}).to_string(),
        )
        .unwrap();
    }

    #[test]
    fn only_complete_checkpoint_directory_names_have_a_step() {
        assert_eq!(step_of_dir("step-00000012"), Some(12));
        for n in [
            "step-00000012.tmp-77",
            "step-00000012.replaced-9",
            "step-",
            "steps-1",
            "step-1a",
        ] {
            assert_eq!(step_of_dir(n), None, "{n}");
        }
    }

    #[test]
    fn a_changed_truncated_or_non_finite_checkpoint_is_refused() {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), &[1.0, -2.0, 3.5], true);
        assert_eq!(verify(d.path()), Ok(7));
        // One flipped bit.
        let p = d.path().join(STATE_FILE);
        let mut b = std::fs::read(&p).unwrap();
        *b.last_mut().unwrap() ^= 1;
        std::fs::write(&p, &b).unwrap();
        assert!(verify(d.path()).unwrap_err().contains("checksum"));
        // Truncated, without a checksum to catch it.
        write(d.path(), &[1.0, 2.0], false);
        let b = std::fs::read(&p).unwrap();
        std::fs::write(&p, &b[..b.len() - 3]).unwrap();
        assert!(verify(d.path()).unwrap_err().contains("truncated"));
        // NaN, with a valid checksum.
        write(d.path(), &[1.0, f32::NAN], true);
        assert!(verify(d.path()).unwrap_err().contains("non-finite"));
        // A header length that overflows (no checksum to catch it): refused, not a panic.
        write(d.path(), &[1.0, 2.0], false);
        let mut b = std::fs::read(&p).unwrap();
        b[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        std::fs::write(&p, &b).unwrap();
        assert!(verify(d.path())
            .unwrap_err()
            .contains("header length out of range"));
        // Missing.
        std::fs::remove_file(&p).unwrap();
        assert!(verify(d.path()).unwrap_err().contains(STATE_FILE));
    }
}
