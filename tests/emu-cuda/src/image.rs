//! What `cuModuleLoadData` is given: a CUBIN (an ELF for the CUDA machine) or PTX text, and
//! whether this driver and device would take it. Returns the kernels' entry names.

use crate::{
    Driver, Fault, ERROR_INVALID_IMAGE, ERROR_INVALID_PTX, ERROR_NO_BINARY_FOR_GPU,
    ERROR_UNSUPPORTED_PTX_VERSION,
};

const EM_CUDA: u16 = 190;

/// The newest PTX ISA a driver of `version` (e.g. 12080 for CUDA 12.8) compiles: the
/// PTX ISA release notes' table (ISA 8.x came with CUDA 12.x, 9.x with 13.x).
pub fn max_ptx_isa(version: i32) -> (u32, u32) {
    let (major, minor) = ((version / 1000) as u32, (version % 1000 / 10) as u32);
    match major {
        13.. => (9, minor),
        12 => match minor {
            0..=5 => (8, minor),
            6 => (8, 5),
            7 | 8 => (8, 7),
            _ => (8, 8),
        },
        11 => (7, minor),
        _ => (6, 0),
    }
}

fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}
fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().unwrap())
}

/// # Safety
/// `p` points to an image as the driver API takes it: NUL-terminated PTX, or an ELF.
pub unsafe fn entries(p: *const u8, d: &Driver) -> Result<Vec<String>, Fault> {
    if p.is_null() {
        return Err((
            crate::ERROR_INVALID_VALUE,
            "cuModuleLoadData of a null image".into(),
        ));
    }
    let head = std::slice::from_raw_parts(p, 64);
    if &head[..4] == b"\x7fELF" {
        // The section headers end the file; its length is their end.
        let (shoff, shentsize, shnum) = (
            u64_at(head, 40) as usize,
            u16_at(head, 58) as usize,
            u16_at(head, 60) as usize,
        );
        let len = shoff + shentsize * shnum;
        return cubin_entries(std::slice::from_raw_parts(p, len), d);
    }
    let text = std::ffi::CStr::from_ptr(p.cast()).to_string_lossy();
    ptx_entries(&text, d)
}

fn cubin_entries(b: &[u8], d: &Driver) -> Result<Vec<String>, Fault> {
    let bad = |why: &str| {
        (
            ERROR_INVALID_IMAGE,
            format!("cuModuleLoadData: not a usable CUBIN ({why})"),
        )
    };
    if b[4] != 2 || u16_at(b, 18) != EM_CUDA {
        return Err(bad("not a 64-bit ELF for the CUDA machine"));
    }
    let flags = u32_at(b, 48);
    // The SM number sits in bits 8..16 of e_flags from ELF ABI version 8 (CUDA 12.8+), in
    // bits 0..8 before.
    let sm = if b[8] >= 8 {
        (flags >> 8) & 0xff
    } else {
        flags & 0xff
    } as i32;
    let (dm, dn) = d.arch;
    if std::env::var_os("DFLASH_EMU_REFUSE_CUBIN").is_some() {
        return Err((ERROR_NO_BINARY_FOR_GPU, format!("cuModuleLoadData: CUBIN for sm_{sm} refused (DFLASH_EMU_REFUSE_CUBIN: a driver that does not know this GPU's CUBIN)")));
    }
    // A CUBIN runs on its own major architecture, same or newer minor.
    if sm / 10 != dm || sm % 10 > dn {
        return Err((
            ERROR_NO_BINARY_FOR_GPU,
            format!("cuModuleLoadData: the CUBIN is for sm_{sm}, this device is sm_{dm}{dn}"),
        ));
    }
    let (shoff, shentsize, shnum) = (
        u64_at(b, 40) as usize,
        u16_at(b, 58) as usize,
        u16_at(b, 60) as usize,
    );
    let sh = |i: usize| shoff + i * shentsize;
    let mut names = Vec::new();
    for i in 0..shnum {
        let h = sh(i);
        if u32_at(b, h + 4) != 2 {
            continue; // SHT_SYMTAB only
        }
        let (off, size, link) = (
            u64_at(b, h + 24) as usize,
            u64_at(b, h + 32) as usize,
            u32_at(b, h + 40) as usize,
        );
        let strtab = u64_at(b, sh(link) + 24) as usize;
        for s in (off..off + size).step_by(24) {
            let info = b[s + 4];
            // STT_FUNC, STB_GLOBAL: a kernel's entry.
            if info & 0xf == 2 && info >> 4 == 1 {
                let name_off = strtab + u32_at(b, s) as usize;
                let end = b[name_off..]
                    .iter()
                    .position(|&c| c == 0)
                    .ok_or_else(|| bad("a symbol name runs off the image"))?;
                names.push(String::from_utf8_lossy(&b[name_off..name_off + end]).into_owned());
            }
        }
    }
    if names.is_empty() {
        return Err(bad("no kernel in its symbol table"));
    }
    Ok(names)
}

fn ptx_entries(text: &str, d: &Driver) -> Result<Vec<String>, Fault> {
    let field = |key: &str| {
        text.lines()
            .find_map(|l| l.trim().strip_prefix(key).map(|r| r.trim().to_string()))
    };
    let Some(version) = field(".version") else {
        return Err((
            ERROR_INVALID_PTX,
            "cuModuleLoadData: neither a CUBIN nor PTX with a .version".into(),
        ));
    };
    let parse = |v: &str| -> Option<(u32, u32)> {
        let (a, b) = v.split_once('.')?;
        Some((a.parse().ok()?, b.parse().ok()?))
    };
    let isa = parse(&version).ok_or((
        ERROR_INVALID_PTX,
        format!("cuModuleLoadData: PTX .version {version}"),
    ))?;
    let max = max_ptx_isa(d.version);
    if isa > max {
        return Err((
            ERROR_UNSUPPORTED_PTX_VERSION,
            format!("cuModuleLoadData: PTX ISA {}.{} is newer than this driver (CUDA {}.{}) compiles (up to {}.{})", isa.0, isa.1, d.version / 1000, d.version % 1000 / 10, max.0, max.1),
        ));
    }
    if let Some(target) = field(".target") {
        let sm: i32 = target
            .trim_start_matches("sm_")
            .chars()
            .take_while(|c| c.is_ascii_digit())
            .collect::<String>()
            .parse()
            .unwrap_or(0);
        if sm > d.arch.0 * 10 + d.arch.1 {
            return Err((
                ERROR_INVALID_PTX,
                format!(
                    "cuModuleLoadData: PTX for {target} on an sm_{}{} device",
                    d.arch.0, d.arch.1
                ),
            ));
        }
    }
    let names: Vec<String> = text
        .lines()
        .filter_map(|l| {
            let i = l.find(".entry ")?;
            Some(
                l[i + 7..]
                    .trim()
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect(),
            )
        })
        .collect();
    if names.is_empty() {
        return Err((
            ERROR_INVALID_PTX,
            "cuModuleLoadData: PTX without an .entry".into(),
        ));
    }
    Ok(names)
}
