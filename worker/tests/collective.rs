//! The drafter group's collectives. The shared-memory one runs here for real: several
//! ranks over one gradient pool, driven in turn (its all-reduce never blocks), through
//! epochs, deaths and a restarted rank. NCCL needs GPUs to all-reduce, but loading it, its
//! version and the unique id the first rank of an epoch creates need none: those run
//! wherever libnccl.so.2 is (`.ci/run` installs it from PyPI; CI=true makes its absence a
//! failure).

use dflash_shared::drafter::GRAD_SLOT_HEADER;
use dflash_shared::pool::{PoolGeometry, PoolMap};
use dflash_worker::collective::shm::ShmCollective;
use dflash_worker::collective::{Collective, Formed};

const N: usize = 1000;

/// A gradient pool for `ranks` ranks, and one collective per rank over its own mapping
/// (as each worker process maps it).
fn group(ranks: u32) -> (Pool, Vec<ShmCollective>) {
    let g = PoolGeometry {
        name: "grads".into(),
        slots: 2 * ranks,
        slot_bytes: GRAD_SLOT_HEADER + N as u64 * 4,
    };
    let (fd, _map) = PoolMap::create(g.clone()).unwrap();
    let pool = Pool { fd, g };
    let members = (0..ranks).map(|r| pool.rank(r)).collect();
    (pool, members)
}

struct Pool {
    fd: std::os::fd::OwnedFd,
    g: PoolGeometry,
}

impl Pool {
    /// A rank's collective in a new process life: its own mapping of the pool.
    fn rank(&self, r: u32) -> ShmCollective {
        use std::os::fd::AsRawFd;
        ShmCollective::new(
            PoolMap::open(self.fd.as_raw_fd(), self.g.clone()).unwrap(),
            r,
            N,
        )
        .unwrap()
    }
}

fn grad(seed: u32) -> Vec<f32> {
    (0..N)
        .map(|i| {
            ((i as u32)
                .wrapping_mul(2654435761)
                .wrapping_add(seed.wrapping_mul(40503))
                % 2001) as f32
                / 1000.0
                - 1.0
        })
        .collect()
}

fn form(c: &mut ShmCollective, epoch: u64, ranks: &[u32]) {
    assert_eq!(c.form(epoch, ranks, None).unwrap(), Formed::Ready);
}

/// Poll each listed rank `rounds` times (the ranks' loops); which completed.
fn drive(cs: &mut [ShmCollective], who: &[usize], rounds: usize) -> Vec<Option<f64>> {
    let mut out = vec![None; cs.len()];
    for _ in 0..rounds {
        for &i in who {
            if let Some(d) = cs[i].progress().unwrap() {
                out[i] = Some(d.weight_sum);
            }
        }
    }
    out
}

#[test]
fn shm_all_reduce_sums_every_ranks_gradient_in_rank_order_to_the_same_bits_on_every_rank() {
    let (_fd, mut cs) = group(3);
    let weights = [1.5, 2.0, 0.25];
    let grads: Vec<Vec<f32>> = (0..3).map(grad).collect();
    for c in cs.iter_mut() {
        form(c, 1, &[0, 1, 2]);
    }
    // Ranks 0 and 2 post; nothing completes until rank 1 has.
    for i in [0, 2] {
        assert!(cs[i].contribute_host(1, weights[i], &grads[i]).unwrap());
    }
    assert_eq!(
        drive(&mut cs, &[0, 2], 50),
        vec![None; 3],
        "complete without rank 1"
    );
    cs[1].contribute_host(1, weights[1], &grads[1]).unwrap();
    let done = drive(&mut cs, &[0, 1, 2], 2);
    assert_eq!(done, vec![Some(3.75); 3], "every rank completes with Σw");
    let mut want: Vec<f32> = grads[0].clone();
    for g in &grads[1..] {
        want.iter_mut().zip(g).for_each(|(a, b)| *a += b);
    }
    want.iter_mut().for_each(|x| *x *= (1.0 / 3.75f64) as f32);
    for c in cs.iter_mut() {
        let got = c.take_sum(1, 3.75).unwrap();
        assert!(
            got.iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "the same bits on every rank"
        );
    }
    // A committed weight sum that is not the all-reduced one is refused.
    for (i, c) in cs.iter_mut().enumerate() {
        c.contribute_host(2, 1.0, &grads[i]).unwrap();
    }
    drive(&mut cs, &[0, 1, 2], 2);
    let err = cs[0].take_sum(2, 2.0).unwrap_err().to_string();
    assert!(err.contains("another membership"), "{err}");
    // A non-finite gradient is reported as such.
    let mut bad = grads[0].clone();
    bad[3] = f32::NAN;
    assert!(!cs[0].contribute_host(3, 1.0, &bad).unwrap());
}

#[test]
fn shm_a_new_epoch_leaves_out_a_dead_rank_and_never_sums_a_previous_lifes_slot() {
    let (pool, mut cs) = group(3);
    let grads: Vec<Vec<f32>> = (10..13).map(grad).collect();
    for c in cs.iter_mut() {
        form(c, 1, &[0, 1, 2]);
    }
    // Step 1 in epoch 1: all three post, rank 1 completes; then it dies before the commit.
    for (i, c) in cs.iter_mut().enumerate() {
        c.contribute_host(1, 1.0, &grads[i]).unwrap();
    }
    assert_eq!(drive(&mut cs, &[0, 1, 2], 2)[1], Some(3.0));
    // Epoch 2 without it: ranks 0 and 2 reduce their own gradients again, and only those.
    for i in [0, 2] {
        form(&mut cs[i], 2, &[0, 2]);
    }
    let done = drive(&mut cs, &[0, 2], 2);
    assert_eq!((done[0], done[2]), (Some(2.0), Some(2.0)));
    let want: Vec<f32> = grads[0]
        .iter()
        .zip(&grads[2])
        .map(|(a, b)| (a + b) * 0.5)
        .collect();
    assert_eq!(cs[0].take_sum(1, 2.0).unwrap(), &want[..]);
    assert_eq!(cs[2].take_sum(1, 2.0).unwrap(), &want[..]);
    // Rank 1 restarts (a new life, the same slots) and joins in epoch 3, at step 2. The
    // others post step 2; rank 1's slot of step 2 still holds nothing of epoch 3.
    cs[1] = pool.rank(1);
    for i in [0, 2] {
        form(&mut cs[i], 3, &[0, 1, 2]);
        cs[i].contribute_host(2, 1.0, &grads[i]).unwrap();
    }
    form(&mut cs[1], 3, &[0, 1, 2]);
    assert_eq!(
        drive(&mut cs, &[0, 2], 20),
        vec![None; 3],
        "no sum before the new life posts"
    );
    let new_life = grad(99);
    cs[1].contribute_host(2, 4.0, &new_life).unwrap();
    let done = drive(&mut cs, &[0, 1, 2], 2);
    assert_eq!(done, vec![Some(6.0); 3]);
    let want: Vec<f32> = (0..N)
        .map(|k| ((grads[0][k] + new_life[k]) + grads[2][k]) * (1.0 / 6.0f64) as f32)
        .collect();
    assert_eq!(
        cs[1].take_sum(2, 6.0).unwrap(),
        &want[..],
        "the new life's gradient, summed in rank order"
    );
}

#[test]
fn shm_refuses_an_epoch_without_this_rank_or_with_ranks_out_of_order() {
    let (_fd, mut cs) = group(2);
    assert!(cs[0]
        .form(1, &[1], None)
        .unwrap_err()
        .to_string()
        .contains("does not include this rank"));
    assert!(cs[0]
        .form(1, &[1, 0], None)
        .unwrap_err()
        .to_string()
        .contains("not ascending"));
    assert!(cs[0]
        .form(1, &[0, 5], None)
        .unwrap_err()
        .to_string()
        .contains("no gradient slot"));
}

#[test]
fn nccl_loads_reports_its_version_and_creates_an_epochs_unique_id_without_a_gpu() {
    use dflash_worker::collective::nccl;
    let lib = match nccl::load() {
        Ok(l) => l,
        Err(why) => {
            let why = why.to_string();
            assert!(
                std::env::var("CI").is_err(),
                "CI=true: NCCL must be installed (.ci/run installs nvidia-nccl-cu13): {why}"
            );
            assert!(
                why.contains("libnccl.so.2") && why.contains("DFLASH_NCCL_LIB"),
                "the error says what and how: {why}"
            );
            eprintln!("skipped: {why}");
            return;
        }
    };
    let (major, minor, patch) = lib.version().unwrap();
    eprintln!("NCCL {major}.{minor}.{patch} from {}", lib.path.display());
    assert_eq!(major, 2);
    assert!(minor >= 18, "2.18 or newer: {minor}");
    let (a, b) = (lib.unique_id().unwrap(), lib.unique_id().unwrap());
    assert_eq!(
        a.len(),
        128,
        "the id the supervisor relays is NCCL's 128 bytes"
    );
    assert!(
        a.iter().any(|&x| x != 0) && a != b,
        "a fresh id for each epoch"
    );
}
