//! `--init-drafter`: the initial weights of a drafter read from a directory in the export
//! layout ([`crate::tools::export::write_hf_dir`] writes it; z-lab publishes its drafters so).

use std::path::Path;

use crate::error::{Result, WorkerError};
use crate::models::drafter::Drafter;

/// The weights of a drafter directory in the export layout (`--init-drafter`; what
/// [`write_hf_dir`](crate::tools::export::write_hf_dir) writes, or a published z-lab DFlash drafter): each tensor of `d`'s
/// layout read from `dir`/model.safetensors by name (bf16, f16 or f32, as f32), the
/// inverse of the export. A tensor missing, of another shape or dtype is refused (a
/// permanent error: restarting would not change the file).
pub fn load_weights(d: &Drafter, dir: &Path) -> Result<Vec<f32>> {
    let path = dir.join("model.safetensors");
    let bad =
        |msg: String| WorkerError::Permanent(format!("--init-drafter {}: {msg}", path.display()));
    let bytes = std::fs::read(&path).map_err(|e| bad(format!("cannot read: {e}")))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
    let mut params = vec![0f32; d.layout.total];
    for (name, shape, off) in &d.layout.entries {
        let t = st.tensor(name).map_err(|_| {
            bad(format!(
                "has no tensor {name} (expected the drafter's tensors as the export names them)"
            ))
        })?;
        if t.shape() != shape.as_slice() {
            return Err(bad(format!(
                "{name} has shape {:?}, expected {shape:?}",
                t.shape()
            )));
        }
        let dst = &mut params[*off..off + shape.iter().product::<usize>()];
        let data = t.data();
        match t.dtype() {
            safetensors::Dtype::BF16 => {
                for (v, b) in dst.iter_mut().zip(data.chunks_exact(2)) {
                    *v = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            safetensors::Dtype::F16 => {
                for (v, b) in dst.iter_mut().zip(data.chunks_exact(2)) {
                    *v = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            safetensors::Dtype::F32 => {
                for (v, b) in dst.iter_mut().zip(data.chunks_exact(4)) {
                    *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            other => {
                return Err(bad(format!(
                    "{name} is {other:?}, expected bf16, f16 or f32"
                )))
            }
        }
    }
    if let Some(i) = params.iter().position(|x| !x.is_finite()) {
        return Err(bad(format!("weight {i} is not finite")));
    }
    Ok(params)
}
