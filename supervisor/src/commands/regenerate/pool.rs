//! The `dflash-worker generate` processes of a regeneration, one per device: each takes
//! one request at a time on its stdin and answers on its stdout (read by a thread of its
//! own into one channel). A process that dies is started again on its device; the
//! request it held is the caller's to send again.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};

use dflash_shared::devices::Device;

use crate::error::Error;

/// Lines of a worker's stderr kept to say why it died.
const TAIL: usize = 8;

/// What a worker says.
#[derive(Debug)]
pub enum Event {
    /// One stdout line of the worker's `life`-th process.
    Reply {
        worker: usize,
        life: u32,
        line: String,
    },
    /// Its stdout closed: the process ended.
    Ended { worker: usize, life: u32 },
}

/// How every worker process is started.
pub struct Spawn {
    pub bin: PathBuf,
    /// `generate`'s arguments, after the subcommand.
    pub args: Vec<String>,
}

struct Worker {
    device: Device,
    child: Child,
    stdin: Option<ChildStdin>,
    stderr: Arc<Mutex<VecDeque<String>>>,
    /// The thread reading stderr: joined once the process ended, so the tail is whole.
    stderr_reader: Option<std::thread::JoinHandle<()>>,
    /// Which start of this worker (from 0): events of an earlier one are stale.
    life: u32,
}

pub struct Pool {
    spawn: Spawn,
    workers: Vec<Worker>,
    tx: Sender<Event>,
    pub rx: Receiver<Event>,
}

impl Pool {
    /// Start one process per device.
    pub fn start(spawn: Spawn, devices: &[Device]) -> Result<Pool, Error> {
        let (tx, rx) = std::sync::mpsc::channel();
        let mut pool = Pool {
            spawn,
            workers: Vec::new(),
            tx,
            rx,
        };
        for (i, &d) in devices.iter().enumerate() {
            let w = pool.launch(i, d, 0)?;
            pool.workers.push(w);
        }
        Ok(pool)
    }

    pub fn count(&self) -> usize {
        self.workers.len()
    }

    pub fn life(&self, worker: usize) -> u32 {
        self.workers[worker].life
    }

    fn launch(&self, i: usize, device: Device, life: u32) -> Result<Worker, Error> {
        let mut cmd = Command::new(&self.spawn.bin);
        cmd.arg("generate").args(&self.spawn.args);
        match device {
            Device::Gpu(g) => {
                cmd.arg("--gpu")
                    .env("CUDA_VISIBLE_DEVICES", g.to_string())
                    .env("CUDA_DEVICE_ORDER", "PCI_BUS_ID");
            }
            Device::Cpu => {
                cmd.env("CUDA_VISIBLE_DEVICES", "");
            }
        }
        let parent = nix::unistd::getpid().as_raw();
        // SAFETY: between fork and exec, only async-signal-safe calls (prctl, getppid).
        unsafe {
            cmd.pre_exec(move || dflash_shared::child::die_with(parent));
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| Error::start(format!("{} generate", self.spawn.bin.display()), e))?;
        let (Some(stdout), Some(stderr)) = (child.stdout.take(), child.stderr.take()) else {
            let _ = child.kill();
            return Err(Error::start(
                format!("{} generate", self.spawn.bin.display()),
                std::io::Error::other("its stdout and stderr were not piped"),
            ));
        };
        let tx = self.tx.clone();
        let read = move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx
                    .send(Event::Reply {
                        worker: i,
                        life,
                        line,
                    })
                    .is_err()
                {
                    return;
                }
            }
            let _ = tx.send(Event::Ended { worker: i, life });
        };
        std::thread::Builder::new()
            .name(format!("generate-{i}"))
            .spawn(read)
            .map_err(|e| Error::start("a reader thread", e))?;
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let keep = tail.clone();
        let errs = move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Ok(mut t) = keep.lock() {
                    if t.len() == TAIL {
                        t.pop_front();
                    }
                    t.push_back(line);
                }
            }
        };
        let stderr_reader = std::thread::Builder::new()
            .name(format!("generate-{i}-err"))
            .spawn(errs)
            .map_err(|e| Error::start("a reader thread", e))?;
        Ok(Worker {
            device,
            stdin: child.stdin.take(),
            child,
            stderr: tail,
            stderr_reader: Some(stderr_reader),
            life,
        })
    }

    /// Send one request line to `worker`; false when its stdin is closed (it died).
    pub fn send(&mut self, worker: usize, line: &str) -> bool {
        let Some(stdin) = self.workers[worker].stdin.as_mut() else {
            return false;
        };
        writeln!(stdin, "{line}")
            .and_then(|_| stdin.flush())
            .is_ok()
    }

    /// The worker's process ended: its exit status and last stderr lines, and a new
    /// process started on its device.
    pub fn restart(&mut self, worker: usize) -> Result<String, Error> {
        let why = self.reap(worker);
        let (device, life) = (self.workers[worker].device, self.workers[worker].life + 1);
        self.workers[worker] = self.launch(worker, device, life)?;
        Ok(why)
    }

    /// Wait for the worker's process and say how it ended.
    pub fn reap(&mut self, worker: usize) -> String {
        let w = &mut self.workers[worker];
        w.stdin = None;
        let status = w
            .child
            .wait()
            .map(|s| s.to_string())
            .unwrap_or_else(|e| e.to_string());
        if let Some(r) = w.stderr_reader.take() {
            let _ = r.join();
        }
        let tail: Vec<String> = w
            .stderr
            .lock()
            .map(|t| t.iter().cloned().collect())
            .unwrap_or_default();
        let last = tail
            .iter()
            .rev()
            .find(|l| l.contains("error"))
            .or(tail.last())
            .cloned()
            .unwrap_or_default();
        format!(
            "{status}{}",
            if last.is_empty() {
                String::new()
            } else {
                format!(": {last}")
            }
        )
    }

    /// Close every stdin (the workers end when they have answered) and wait for them.
    pub fn close(mut self) {
        for w in &mut self.workers {
            w.stdin = None;
        }
        for w in &mut self.workers {
            let _ = w.child.wait();
        }
    }

    /// Kill every worker now.
    pub fn kill(mut self) {
        for w in &mut self.workers {
            let _ = w.child.kill();
            let _ = w.child.wait();
        }
    }
}
