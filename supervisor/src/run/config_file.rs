//! `--config FILE`: a TOML file with a `[drafter]` section. Flags on the command line win
//! over the file; the file wins over the defaults.

use std::path::Path;

use serde::Deserialize;

use crate::cli::RunArgs;
use crate::error::Error;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    drafter: Option<Drafter>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Drafter {
    layers: Option<usize>,
    block_size: Option<usize>,
    max_anchors: Option<usize>,
    lr: Option<f64>,
    warmup_ratio: Option<f64>,
    steps: Option<u64>,
    gamma: Option<f64>,
    mask_token_id: Option<u32>,
}

/// Fill every setting the command line left unset from `path`.
pub fn apply(path: &Path, args: &mut RunArgs) -> Result<(), Error> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::input(format!("--config {}", path.display()), e))?;
    let f: File = toml::from_str(&text).map_err(|e| {
        let line = e.span().map(|sp| text[..sp.start.min(text.len())].lines().count().max(1));
        let msg = format!("{}{}", line.map(|l| format!("line {l}: ")).unwrap_or_default(), e.message().trim().replace('\n', " "));
        Error::Flag(format!("--config {}: {msg} (expected a [drafter] section with layers, block_size, max_anchors, lr, warmup_ratio, steps, gamma, mask_token_id)", path.display()))
    })?;
    let Some(d) = f.drafter else { return Ok(()) };
    args.draft_layers = args.draft_layers.or(d.layers);
    args.block_size = args.block_size.or(d.block_size);
    args.max_anchors = args.max_anchors.or(d.max_anchors);
    args.lr = args.lr.or(d.lr);
    args.warmup_ratio = args.warmup_ratio.or(d.warmup_ratio);
    args.steps = args.steps.or(d.steps);
    args.gamma = args.gamma.or(d.gamma);
    args.mask_token_id = args.mask_token_id.or(d.mask_token_id);
    Ok(())
}
