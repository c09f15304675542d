//! `dflash-supervise gpus`: the GPUs NVML sees, or why there are none.

use crate::telemetry::gpus::list;

/// `dflash-supervise gpus`.
pub fn run(json: bool) -> Result<i32, crate::error::Error> {
    let r = list();
    if json {
        let v = match &r {
            Ok((driver, gpus)) => serde_json::json!({"driver": driver, "gpus": gpus}),
            Err(e) => serde_json::json!({"driver": null, "gpus": [], "error": e.to_string()}),
        };
        println!("{v:#}");
        return Ok(dflash_shared::exit_codes::SUCCESS);
    }
    match r {
        Ok((driver, gpus)) => {
            println!("NVIDIA driver {driver}, {} GPU(s)", gpus.len());
            for g in gpus {
                let mem = g
                    .memory_total_bytes
                    .map(|b| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64))
                    .unwrap_or_else(|| "memory unknown".into());
                println!("  {}  {}  {}  {mem}", g.index, g.name, g.uuid);
            }
        }
        Err(e) => println!("{e}: no GPU can be used; runs use CPU workers (--gpus cpu:N)"),
    }
    Ok(dflash_shared::exit_codes::SUCCESS)
}
