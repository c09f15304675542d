//! A fake `libnvidia-ml.so` for tests on machines without a GPU. The supervisor loads it
//! through its NVML library override (`DFLASH_NVML_LIBRARY`), so the real NVML code path
//! runs. Answers come from the JSON file named by `DFLASH_FAKE_NVML`:
//!
//! ```json
//! {"driver": "550.54.15",
//!  "devices": [{"name": "Fake H200", "uuid": "GPU-0000", "memory_total": 150000000000, "memory_used": 1000}],
//!  "fail": {"nvmlDeviceGetMemoryInfo_v2": 999}}
//! ```
//!
//! `fail` maps an NVML function name to the return code it gives instead of success
//! (999 = NVML_ERROR_UNKNOWN). The file is re-read on every call, so a test can change
//! the script while the supervisor runs.
#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::ffi::c_char;

const SUCCESS: u32 = 0;
const INVALID_ARGUMENT: u32 = 2;
const UNINITIALIZED: u32 = 1;

/// The parsed script, re-read only when the file changes (a test may rewrite it mid-run).
fn script() -> serde_json::Value {
    use std::sync::Mutex;
    static CACHE: Mutex<Option<(std::time::SystemTime, u64, serde_json::Value)>> = Mutex::new(None);
    let Some(path) = std::env::var_os("DFLASH_FAKE_NVML") else {
        return serde_json::Value::Null;
    };
    let Ok(meta) = std::fs::metadata(&path) else {
        return serde_json::Value::Null;
    };
    let key = (meta.modified().unwrap_or(std::time::UNIX_EPOCH), meta.len());
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((m, l, v)) = cache.as_ref() {
        if (*m, *l) == key {
            return v.clone();
        }
    }
    let v = std::fs::read_to_string(&path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(serde_json::Value::Null);
    *cache = Some((key.0, key.1, v.clone()));
    v
}

fn failing(s: &serde_json::Value, func: &str) -> Option<u32> {
    s["fail"][func].as_u64().map(|c| c as u32)
}

fn device(s: &serde_json::Value, handle: *mut u8) -> Option<&serde_json::Value> {
    // Handles are 1-based indices disguised as pointers.
    let i = (handle as usize).checked_sub(1)?;
    s["devices"].as_array()?.get(i)
}

unsafe fn write_str(dst: *mut c_char, len: u32, text: &str) -> u32 {
    let bytes = text.as_bytes();
    if dst.is_null() || bytes.len() + 1 > len as usize {
        return 7; // NVML_ERROR_INSUFFICIENT_SIZE
    }
    // SAFETY: the caller gave a buffer of `len` bytes; we write at most bytes.len() + 1.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst as *mut u8, bytes.len());
        *dst.add(bytes.len()) = 0;
    }
    SUCCESS
}

/// `"init_ok_times": N` in the script: only the first N initialisations succeed (a
/// driver that goes away after start-up). They are counted in the file next to the
/// script, `<script>.inits`, since the library is unloaded between uses.
#[no_mangle]
pub extern "C" fn nvmlInit_v2() -> u32 {
    let s = script();
    if s.is_null() {
        return UNINITIALIZED;
    }
    if let (Some(ok), Some(path)) = (
        s["init_ok_times"].as_u64(),
        std::env::var_os("DFLASH_FAKE_NVML"),
    ) {
        let mut counter = path;
        counter.push(".inits");
        let n: u64 = std::fs::read_to_string(&counter)
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0);
        let _ = std::fs::write(&counter, (n + 1).to_string());
        if n >= ok {
            return 9; // NVML_ERROR_DRIVER_NOT_LOADED
        }
    }
    failing(&s, "nvmlInit_v2").unwrap_or(SUCCESS)
}

#[no_mangle]
pub extern "C" fn nvmlShutdown() -> u32 {
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut u32) -> u32 {
    let s = script();
    if let Some(c) = failing(&s, "nvmlDeviceGetCount_v2") {
        return c;
    }
    // SAFETY: out-parameter supplied by the caller.
    unsafe { *count = s["devices"].as_array().map_or(0, |d| d.len()) as u32 };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(index: u32, handle: *mut *mut u8) -> u32 {
    let s = script();
    if let Some(c) = failing(&s, "nvmlDeviceGetHandleByIndex_v2") {
        return c;
    }
    if index as usize >= s["devices"].as_array().map_or(0, |d| d.len()) {
        return INVALID_ARGUMENT;
    }
    // SAFETY: out-parameter supplied by the caller.
    unsafe { *handle = (index as usize + 1) as *mut u8 };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetName(handle: *mut u8, name: *mut c_char, len: u32) -> u32 {
    let s = script();
    if let Some(c) = failing(&s, "nvmlDeviceGetName") {
        return c;
    }
    let Some(d) = device(&s, handle) else {
        return INVALID_ARGUMENT;
    };
    // SAFETY: buffer from the caller.
    unsafe { write_str(name, len, d["name"].as_str().unwrap_or("Fake GPU")) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUUID(handle: *mut u8, uuid: *mut c_char, len: u32) -> u32 {
    let s = script();
    if let Some(c) = failing(&s, "nvmlDeviceGetUUID") {
        return c;
    }
    let Some(d) = device(&s, handle) else {
        return INVALID_ARGUMENT;
    };
    // SAFETY: buffer from the caller.
    unsafe { write_str(uuid, len, d["uuid"].as_str().unwrap_or("GPU-fake")) }
}

#[repr(C)]
pub struct MemoryV2 {
    version: u32,
    total: u64,
    reserved: u64,
    free: u64,
    used: u64,
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(handle: *mut u8, mem: *mut MemoryV2) -> u32 {
    let s = script();
    if let Some(c) = failing(&s, "nvmlDeviceGetMemoryInfo_v2") {
        return c;
    }
    let Some(d) = device(&s, handle) else {
        return INVALID_ARGUMENT;
    };
    let total = d["memory_total"].as_u64().unwrap_or(0);
    let used = d["memory_used"].as_u64().unwrap_or(0);
    // SAFETY: out-parameter supplied by the caller.
    unsafe {
        (*mem).total = total;
        (*mem).reserved = 0;
        (*mem).used = used;
        (*mem).free = total.saturating_sub(used);
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(version: *mut c_char, len: u32) -> u32 {
    let s = script();
    if let Some(c) = failing(&s, "nvmlSystemGetDriverVersion") {
        return c;
    }
    // SAFETY: buffer from the caller.
    unsafe { write_str(version, len, s["driver"].as_str().unwrap_or("0.0")) }
}

#[no_mangle]
pub extern "C" fn nvmlErrorString(_result: u32) -> *const c_char {
    c"fake NVML error".as_ptr()
}

/// A numeric field of the device, or the scripted failure of `func`.
fn field(handle: *mut u8, func: &str, key: &str) -> Result<u64, u32> {
    let s = script();
    if let Some(c) = failing(&s, func) {
        return Err(c);
    }
    let d = device(&s, handle).ok_or(INVALID_ARGUMENT)?;
    d[key].as_u64().ok_or(3) // NVML_ERROR_NOT_SUPPORTED
}

/// Store a scripted value through an out-parameter, or pass the scripted failure on.
///
/// # Safety
/// `out` is a valid out-parameter from the caller.
unsafe fn store<T>(out: *mut T, r: Result<u64, u32>, conv: fn(u64) -> T) -> u32 {
    match r {
        Ok(v) => {
            // SAFETY: promised by the caller.
            unsafe { *out = conv(v) };
            SUCCESS
        }
        Err(c) => c,
    }
}

macro_rules! getter {
    ($name:ident, $key:literal, $ty:ty) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(handle: *mut u8, out: *mut $ty) -> u32 {
            // SAFETY: out-parameter supplied by the caller.
            unsafe { store(out, field(handle, stringify!($name), $key), |v| v as $ty) }
        }
    };
}

getter!(nvmlDeviceGetPowerUsage, "power_mw", u32);
getter!(nvmlDeviceGetEnforcedPowerLimit, "power_limit_mw", u32);
getter!(nvmlDeviceGetTotalEnergyConsumption, "energy_mj", u64);

#[repr(C)]
pub struct Utilization {
    gpu: u32,
    memory: u32,
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    handle: *mut u8,
    out: *mut Utilization,
) -> u32 {
    let (g, m) = match (
        field(handle, "nvmlDeviceGetUtilizationRates", "util_gpu"),
        field(handle, "nvmlDeviceGetUtilizationRates", "util_mem"),
    ) {
        (Ok(g), Ok(m)) => (g, m),
        (Err(c), _) | (_, Err(c)) => return c,
    };
    // SAFETY: out-parameter supplied by the caller.
    unsafe {
        (*out).gpu = g as u32;
        (*out).memory = m as u32;
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetTemperature(
    handle: *mut u8,
    _sensor: u32,
    out: *mut u32,
) -> u32 {
    // SAFETY: out-parameter supplied by the caller.
    unsafe {
        store(
            out,
            field(handle, "nvmlDeviceGetTemperature", "temp_c"),
            |v| v as u32,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetClockInfo(handle: *mut u8, clock: u32, out: *mut u32) -> u32 {
    // NVML_CLOCK_SM = 1, NVML_CLOCK_MEM = 2
    let key = if clock == 2 {
        "mem_clock_mhz"
    } else {
        "sm_clock_mhz"
    };
    // SAFETY: out-parameter supplied by the caller.
    unsafe {
        store(out, field(handle, "nvmlDeviceGetClockInfo", key), |v| {
            v as u32
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPcieThroughput(
    handle: *mut u8,
    counter: u32,
    out: *mut u32,
) -> u32 {
    // NVML_PCIE_UTIL_TX_BYTES = 0, NVML_PCIE_UTIL_RX_BYTES = 1
    let key = if counter == 0 {
        "pcie_tx_kbps"
    } else {
        "pcie_rx_kbps"
    };
    // SAFETY: out-parameter supplied by the caller.
    unsafe {
        store(
            out,
            field(handle, "nvmlDeviceGetPcieThroughput", key),
            |v| v as u32,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetTotalEccErrors(
    handle: *mut u8,
    error_type: u32,
    _counter: u32,
    out: *mut u64,
) -> u32 {
    // NVML_MEMORY_ERROR_TYPE_CORRECTED = 0, UNCORRECTED = 1
    let key = if error_type == 0 {
        "ecc_corrected"
    } else {
        "ecc_uncorrected"
    };
    // SAFETY: out-parameter supplied by the caller.
    unsafe {
        store(
            out,
            field(handle, "nvmlDeviceGetTotalEccErrors", key),
            |v| v,
        )
    }
}

getter!(
    nvmlDeviceGetCurrentClocksThrottleReasons,
    "throttle_mask",
    u64
);

#[repr(C)]
pub struct ProcessInfo {
    pid: u32,
    used: u64,
    gpu_instance: u32,
    compute_instance: u32,
}

/// `"processes": [[pid, bytes], ...]` on a device.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    handle: *mut u8,
    count: *mut u32,
    infos: *mut ProcessInfo,
) -> u32 {
    let s = script();
    if let Some(c) = failing(&s, "nvmlDeviceGetComputeRunningProcesses_v3") {
        return c;
    }
    let Some(d) = device(&s, handle) else {
        return INVALID_ARGUMENT;
    };
    let procs: Vec<(u32, u64)> = d["processes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| Some((p[0].as_u64()? as u32, p[1].as_u64()?)))
        .collect();
    // SAFETY: count and infos come from the caller; infos holds *count entries.
    unsafe {
        if infos.is_null() || (*count as usize) < procs.len() {
            *count = procs.len() as u32;
            return if procs.is_empty() { SUCCESS } else { 7 }; // NVML_ERROR_INSUFFICIENT_SIZE
        }
        for (i, (pid, used)) in procs.iter().enumerate() {
            *infos.add(i) = ProcessInfo {
                pid: *pid,
                used: *used,
                gpu_instance: 0,
                compute_instance: 0,
            };
        }
        *count = procs.len() as u32;
    }
    SUCCESS
}

/// XID events: `"xid": [[gpu_index, code], ...]` in the script, delivered once each, in
/// order, through the event set (non-blocking waits time out when none is left).
static XIDS_DELIVERED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[no_mangle]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut *mut u8) -> u32 {
    // SAFETY: out-parameter supplied by the caller.
    unsafe { *set = std::ptr::dangling_mut::<u8>() };
    SUCCESS
}

#[no_mangle]
pub extern "C" fn nvmlDeviceRegisterEvents(handle: *mut u8, _types: u64, _set: *mut u8) -> u32 {
    let s = script();
    if let Some(c) = failing(&s, "nvmlDeviceRegisterEvents") {
        return c;
    }
    if device(&s, handle).is_none() {
        return INVALID_ARGUMENT;
    }
    SUCCESS
}

#[repr(C)]
pub struct EventData {
    device: *mut u8,
    event_type: u64,
    event_data: u64,
    gpu_instance: u32,
    compute_instance: u32,
}

#[no_mangle]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    _set: *mut u8,
    data: *mut EventData,
    _timeout_ms: u32,
) -> u32 {
    let s = script();
    let events: Vec<(u64, u64)> = s["xid"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| Some((e[0].as_u64()?, e[1].as_u64()?)))
        .collect();
    let i = XIDS_DELIVERED.load(std::sync::atomic::Ordering::SeqCst);
    let Some(&(gpu, code)) = events.get(i) else {
        return 10;
    }; // NVML_ERROR_TIMEOUT
    XIDS_DELIVERED.store(i + 1, std::sync::atomic::Ordering::SeqCst);
    // SAFETY: out-parameter supplied by the caller.
    unsafe {
        *data = EventData {
            device: (gpu as usize + 1) as *mut u8,
            event_type: 8,
            event_data: code,
            gpu_instance: 0,
            compute_instance: 0,
        };
    }
    SUCCESS
}

#[no_mangle]
pub extern "C" fn nvmlEventSetFree(_set: *mut u8) -> u32 {
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetIndex(handle: *mut u8, index: *mut u32) -> u32 {
    let Some(i) = (handle as usize).checked_sub(1) else {
        return INVALID_ARGUMENT;
    };
    // SAFETY: out-parameter supplied by the caller.
    unsafe { *index = i as u32 };
    SUCCESS
}
