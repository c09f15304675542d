//! nextest's kill limit (`.config/nextest.toml`: slow-timeout period × terminate-after)
//! leaves every e2e test binary time to reach its own deadline and print its own
//! diagnostic: the kill limit of each binary exceeds its longest `Duration::from_secs(N)`
//! by at least a minute, in every profile.

use std::fs;
use std::path::Path;
use std::time::Duration;

const MARGIN: Duration = Duration::from_secs(60);

fn secs(v: &str) -> Duration {
    let n = v
        .strip_suffix('s')
        .unwrap_or_else(|| panic!("period '{v}' is not in seconds (Ns)"));
    Duration::from_secs(n.parse().unwrap_or_else(|_| panic!("period '{v}'")))
}

/// period × terminate-after of a slow-timeout table; None if it never kills.
fn kill_limit(t: &toml::Value) -> Option<Duration> {
    let period = secs(t["period"].as_str().expect("slow-timeout.period"));
    let after = t
        .get("terminate-after")?
        .as_integer()
        .expect("terminate-after") as u32;
    Some(period * after)
}

/// The binaries an override's filter names: only `binary(a) | binary(b)` is understood,
/// anything else fails this test rather than being misread.
fn binaries(filter: &str) -> Vec<String> {
    filter
        .split('|')
        .map(|f| {
            let f = f.trim();
            f.strip_prefix("binary(")
                .and_then(|f| f.strip_suffix(')'))
                .unwrap_or_else(|| {
                    panic!("filter '{filter}': only binary(NAME) | ... is understood here")
                })
                .to_string()
        })
        .collect()
}

/// The kill limit of test binary `bin` in `profile`: the profile's overrides, then the
/// default profile's, then the profile's own slow-timeout, then the default's.
fn kill_limit_of(cfg: &toml::Value, profile: &str, bin: &str) -> Option<Duration> {
    let p = |name: &str| {
        cfg["profile"]
            .get(name)
            .cloned()
            .unwrap_or(toml::Value::Table(Default::default()))
    };
    let (this, default) = (p(profile), p("default"));
    for prof in [&this, &default] {
        for o in prof
            .get("overrides")
            .and_then(|o| o.as_array())
            .into_iter()
            .flatten()
        {
            if let (Some(filter), Some(st)) = (
                o.get("filter").and_then(|f| f.as_str()),
                o.get("slow-timeout"),
            ) {
                if binaries(filter).iter().any(|b| b == bin) {
                    return kill_limit(st);
                }
            }
        }
    }
    let st = this
        .get("slow-timeout")
        .or(default.get("slow-timeout"))
        .expect("a slow-timeout");
    kill_limit(st)
}

/// The longest `Duration::from_secs(N)` in a test source.
fn longest_deadline(src: &str) -> Option<Duration> {
    src.match_indices("Duration::from_secs(")
        .filter_map(|(i, m)| {
            let rest = &src[i + m.len()..];
            rest[..rest.find(')')?].trim().parse::<u64>().ok()
        })
        .max()
        .map(Duration::from_secs)
}

#[test]
fn every_test_binary_reaches_its_own_deadline_before_nextest_kills_it() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let cfg: toml::Value =
        toml::from_str(&fs::read_to_string(root.join(".config/nextest.toml")).unwrap()).unwrap();
    let mut checked = 0;
    for entry in fs::read_dir(root.join("tests/tests")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let bin = path.file_stem().unwrap().to_str().unwrap().to_string();
        if bin == "nextest_config" {
            continue; // this file's durations are examples, not deadlines
        }
        let Some(deadline) = longest_deadline(&fs::read_to_string(&path).unwrap()) else {
            continue;
        };
        for profile in ["default", "ci"] {
            let Some(limit) = kill_limit_of(&cfg, profile, &bin) else {
                continue;
            };
            assert!(
                deadline + MARGIN <= limit,
                "{bin}: its own deadline is {deadline:?}, nextest kills it at {limit:?} in profile {profile}: raise its kill limit in .config/nextest.toml to at least {:?}",
                deadline + MARGIN
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 10,
        "sanity: only {checked} binary/profile pairs had deadlines"
    );
}

#[test]
fn the_checks_own_reading_of_the_config_is_right() {
    let cfg: toml::Value = toml::from_str(
        r#"
        [profile.default]
        slow-timeout = { period = "30s", terminate-after = 4 }
        [[profile.default.overrides]]
        filter = 'binary(slow) | binary(slower)'
        slow-timeout = { period = "60s", terminate-after = 3 }
        [profile.ci]
        "#,
    )
    .unwrap();
    assert_eq!(
        kill_limit_of(&cfg, "default", "fast"),
        Some(Duration::from_secs(120))
    );
    assert_eq!(
        kill_limit_of(&cfg, "default", "slower"),
        Some(Duration::from_secs(180))
    );
    assert_eq!(
        kill_limit_of(&cfg, "ci", "slow"),
        Some(Duration::from_secs(180))
    );
    assert_eq!(
        longest_deadline(
            "const T: Duration = Duration::from_secs(120); x(Duration::from_secs(20))"
        ),
        Some(Duration::from_secs(120))
    );
}
