//! `LD_PRELOAD=libdflash_fault_inject.so`: a fault at an exact instant, for the e2e tests.
//!
//! Configured by the environment of the process it is loaded into:
//! - `DFLASH_FAULT_CALL`: `mkdir`, `open` (only opens that create a file), `rename`,
//!   `statvfs` or `write`;
//! - `DFLASH_FAULT_PATH`: the fault fires when the call's path contains this text
//!   (`rename`: its source or destination; `write`: the file its descriptor is open on, so
//!   `errno:30` is a filesystem that turned read-only under a file already open);
//! - `DFLASH_FAULT_ACTION`: `errno:N` (the call fails with errno N, nothing done), `kill`
//!   (the process SIGKILLs itself, nothing done), `delay:MS` (then the call goes on) or,
//!   for `statvfs`, `free:BYTES` (the call succeeds and reports that much free space: a
//!   nearly full filesystem), or `hold:FILE` (the process writes its PID to `FILE.held`,
//!   then waits until `FILE` exists before the call goes on: a test acts while a process
//!   is exactly there);
//! - `DFLASH_FAULT_IF_ENV` (optional): `NAME=VALUE`; only processes whose environment has
//!   it are touched (e.g. `DFLASH_ROLE=drafter`), so the supervisor and the other workers
//!   that inherit the preload run unharmed.
//!
//! Everything else goes to the real libc function (`dlsym(RTLD_NEXT)`).

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

enum Action {
    Errno(c_int),
    Kill,
    Delay(u64),
    Free(u64),
    Hold(String),
}

struct Rule {
    call: String,
    path: String,
    action: Action,
}

fn rule() -> Option<&'static Rule> {
    static RULE: OnceLock<Option<Rule>> = OnceLock::new();
    RULE.get_or_init(|| {
        let call = std::env::var("DFLASH_FAULT_CALL").ok()?;
        let path = std::env::var("DFLASH_FAULT_PATH").ok()?;
        let action = std::env::var("DFLASH_FAULT_ACTION").ok()?;
        if let Ok(cond) = std::env::var("DFLASH_FAULT_IF_ENV") {
            let (k, v) = cond.split_once('=')?;
            if std::env::var(k).ok()? != v {
                return None;
            }
        }
        let action = if action == "kill" {
            Action::Kill
        } else if let Some(n) = action.strip_prefix("errno:") {
            Action::Errno(n.parse().ok()?)
        } else if let Some(ms) = action.strip_prefix("delay:") {
            Action::Delay(ms.parse().ok()?)
        } else if let Some(f) = action.strip_prefix("hold:") {
            Action::Hold(f.to_string())
        } else if let Some(b) = action.strip_prefix("free:") {
            Action::Free(b.parse().ok()?)
        } else {
            return None;
        };
        Some(Rule { call, path, action })
    })
    .as_ref()
}

/// Whether the call must fail (with errno set); kills or delays as the rule says.
unsafe fn fault(call: &str, paths: &[*const c_char]) -> bool {
    let Some(r) = rule() else { return false };
    if r.call != call {
        return false;
    }
    let hit = paths.iter().any(|&p| {
        !p.is_null()
            && CStr::from_ptr(p)
                .to_str()
                .is_ok_and(|s| s.contains(r.path.as_str()))
    });
    if !hit {
        return false;
    }
    match r.action {
        Action::Kill => {
            libc::kill(libc::getpid(), libc::SIGKILL);
            false
        }
        Action::Errno(n) => {
            *libc::__errno_location() = n;
            true
        }
        Action::Delay(ms) => {
            std::thread::sleep(std::time::Duration::from_millis(ms));
            false
        }
        Action::Hold(ref file) => {
            let _ = std::fs::write(format!("{file}.held"), std::process::id().to_string());
            while !std::path::Path::new(file).exists() {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            false
        }
        // Not a failure: `statvfs` reports it (see there).
        Action::Free(_) => false,
    }
}

/// # Safety
/// As libc's `statvfs`.
#[no_mangle]
pub unsafe extern "C" fn statvfs(path: *const c_char, buf: *mut libc::statvfs) -> c_int {
    let f: unsafe extern "C" fn(*const c_char, *mut libc::statvfs) -> c_int = real(c"statvfs");
    let rc = f(path, buf);
    let Some(r) = rule() else { return rc };
    if rc != 0 || r.call != "statvfs" || path.is_null() {
        return rc;
    }
    if let Action::Free(bytes) = r.action {
        if CStr::from_ptr(path)
            .to_str()
            .is_ok_and(|s| s.contains(r.path.as_str()))
        {
            let frag = (*buf).f_frsize.max(1);
            (*buf).f_bavail = bytes / frag;
            (*buf).f_bfree = bytes / frag;
        }
    }
    rc
}

unsafe fn real<F>(name: &CStr) -> F {
    let f = libc::dlsym(libc::RTLD_NEXT, name.as_ptr());
    assert!(!f.is_null(), "no {name:?} in libc");
    std::mem::transmute_copy(&f)
}

/// # Safety
/// As libc's `write`. Only under a `write` rule is the descriptor's file looked at (its
/// `/proc/self/fd` link, read without allocating); libc's `write` is looked up once.
#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: libc::size_t) -> libc::ssize_t {
    static REAL: AtomicUsize = AtomicUsize::new(0);
    if rule().is_some_and(|r| r.call == "write") {
        // "/proc/self/fd/" and the descriptor's digits, NUL-terminated, on the stack.
        let mut link = *b"/proc/self/fd/\0\0\0\0\0\0\0\0\0\0\0\0";
        let (mut digits, mut v, mut len) = ([0u8; 11], fd.unsigned_abs(), 0);
        loop {
            digits[len] = b'0' + (v % 10) as u8;
            len += 1;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        for i in 0..len {
            link[14 + i] = digits[len - 1 - i];
        }
        let mut target = [0 as c_char; 4096];
        let got = libc::readlink(link.as_ptr().cast(), target.as_mut_ptr(), target.len() - 1);
        if got > 0 && fault("write", &[target.as_ptr()]) {
            return -1;
        }
    }
    let mut f = REAL.load(Ordering::Relaxed);
    if f == 0 {
        f = libc::dlsym(libc::RTLD_NEXT, c"write".as_ptr()) as usize;
        assert!(f != 0, "no write in libc");
        REAL.store(f, Ordering::Relaxed);
    }
    let f: unsafe extern "C" fn(c_int, *const c_void, libc::size_t) -> libc::ssize_t =
        std::mem::transmute(f);
    f(fd, buf, n)
}

/// # Safety
/// As libc's `mkdir`.
#[no_mangle]
pub unsafe extern "C" fn mkdir(path: *const c_char, mode: libc::mode_t) -> c_int {
    if fault("mkdir", &[path]) {
        return -1;
    }
    let f: unsafe extern "C" fn(*const c_char, libc::mode_t) -> c_int = real(c"mkdir");
    f(path, mode)
}

/// # Safety
/// As libc's `rename`.
#[no_mangle]
pub unsafe extern "C" fn rename(from: *const c_char, to: *const c_char) -> c_int {
    if fault("rename", &[from, to]) {
        return -1;
    }
    let f: unsafe extern "C" fn(*const c_char, *const c_char) -> c_int = real(c"rename");
    f(from, to)
}

// `open` is variadic in C; the mode is the third integer argument when O_CREAT is given,
// which the x86-64 and aarch64 calling conventions pass as a plain third argument.
macro_rules! open_like {
    ($name:ident, $cname:literal) => {
        /// # Safety
        /// As libc's function of this name.
        #[no_mangle]
        pub unsafe extern "C" fn $name(path: *const c_char, flags: c_int, mode: c_uint) -> c_int {
            if flags & libc::O_CREAT != 0 && fault("open", &[path]) {
                return -1;
            }
            let f: unsafe extern "C" fn(*const c_char, c_int, c_uint) -> c_int = real($cname);
            f(path, flags, mode)
        }
    };
}
open_like!(open, c"open");
open_like!(open64, c"open64");

macro_rules! openat_like {
    ($name:ident, $cname:literal) => {
        /// # Safety
        /// As libc's function of this name.
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            dir: c_int,
            path: *const c_char,
            flags: c_int,
            mode: c_uint,
        ) -> c_int {
            if flags & libc::O_CREAT != 0 && fault("open", &[path]) {
                return -1;
            }
            let f: unsafe extern "C" fn(c_int, *const c_char, c_int, c_uint) -> c_int =
                real($cname);
            f(dir, path, flags, mode)
        }
    };
}
openat_like!(openat, c"openat");
openat_like!(openat64, c"openat64");
