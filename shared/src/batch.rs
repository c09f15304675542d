//! Batch payload formats, as they lie in pool slots. Little-endian, versioned, checked on
//! read: a consumer never trusts a length it did not verify.
//!
//! Token batch (loader → target):
//! `"DFTB" v1 | batch_id u64 | rows u32 | seq_len u32 | lengths[rows] u32 |
//!  input_ids[rows*seq_len] u32 | loss_mask[rows*seq_len] u8`
//!
//! Hidden-state batch (target → drafter): the capture spec travels in every batch (see
//! DFLASH.md, "The capture spec is a contract"), then the tokens, then the tapped hidden
//! states and a checksum over them:
//! `"DFHB" v1 | batch_id u64 | rows u32 | seq_len u32 | n_taps u32 | hidden u32 |
//!  dtype u32 | target u64 | tap_ids[n_taps] u32 | lengths | input_ids | loss_mask |
//!  hidden[rows*seq_len*n_taps*hidden] (2 bytes each, bf16) | checksum u64`

use serde::{Deserialize, Serialize};

const TOKEN_MAGIC: &[u8; 4] = b"DFTB";
const HIDDEN_MAGIC: &[u8; 4] = b"DFHB";
const VERSION: u32 = 1;
/// dtype code of bf16 hidden states.
pub const DTYPE_BF16: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    #[error("batch needs {need} bytes but the slot holds {have}")]
    TooBig { need: usize, have: usize },
    #[error("not a {0} batch (bad magic or version)")]
    BadMagic(&'static str),
    #[error("batch is truncated: {0}")]
    Truncated(&'static str),
    #[error("batch is inconsistent: {0}")]
    Inconsistent(String),
    #[error("hidden-state checksum mismatch: the payload is corrupt")]
    Checksum,
}

/// Batch ids at or above this are held-out evaluation batches (`--eval-data`): bit 62
/// set, the eval round in bits 24..62 and the batch's index in the eval set below. The
/// loader's training ids never get there, so an id alone says which kind a batch is.
pub const EVAL_BATCH_BASE: u64 = 1 << 62;
const EVAL_INDEX_BITS: u32 = 24;

/// Is `batch_id` a held-out evaluation batch?
pub fn is_eval_batch(batch_id: u64) -> bool {
    batch_id >= EVAL_BATCH_BASE
}

/// The id of eval batch `index` (its place in the eval set) in eval round `round`.
pub fn eval_batch_id(round: u64, index: u64) -> u64 {
    EVAL_BATCH_BASE | (round << EVAL_INDEX_BITS) | (index & ((1 << EVAL_INDEX_BITS) - 1))
}

/// (round, index) of an eval batch id.
pub fn eval_batch_parts(batch_id: u64) -> (u64, u64) {
    let b = batch_id & !EVAL_BATCH_BASE;
    (b >> EVAL_INDEX_BITS, b & ((1 << EVAL_INDEX_BITS) - 1))
}

/// Eval batches in one eval set at most (the index bits).
pub const MAX_EVAL_BATCHES: u64 = 1 << EVAL_INDEX_BITS;

/// Padded rows of token ids with their loss masks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenBatch {
    pub batch_id: u64,
    pub seq_len: u32,
    pub lengths: Vec<u32>,
    /// rows × seq_len, padded with 0.
    pub input_ids: Vec<u32>,
    /// rows × seq_len, 0 on padding.
    pub loss_mask: Vec<u8>,
}

impl TokenBatch {
    pub fn rows(&self) -> usize {
        self.lengths.len()
    }

    /// Real (unpadded) tokens.
    pub fn tokens(&self) -> u64 {
        self.lengths.iter().map(|&l| l as u64).sum()
    }

    pub fn encoded_len(&self) -> usize {
        token_section_len(self.rows(), self.seq_len as usize) + 24
    }

    pub fn encode_into(&self, buf: &mut [u8]) -> Result<usize, BatchError> {
        let need = self.encoded_len();
        if need > buf.len() {
            return Err(BatchError::TooBig {
                need,
                have: buf.len(),
            });
        }
        let mut w = Writer { buf, pos: 0 };
        w.bytes(TOKEN_MAGIC);
        w.u32(VERSION);
        w.u64(self.batch_id);
        w.u32(self.rows() as u32);
        w.u32(self.seq_len);
        self.write_tokens(&mut w);
        Ok(w.pos)
    }

    fn write_tokens(&self, w: &mut Writer) {
        for &l in &self.lengths {
            w.u32(l);
        }
        for &t in &self.input_ids {
            w.u32(t);
        }
        w.bytes(&self.loss_mask);
    }

    pub fn decode(buf: &[u8]) -> Result<TokenBatch, BatchError> {
        let mut r = Reader { buf, pos: 0 };
        if r.take(4, "magic")? != TOKEN_MAGIC || r.u32()? != VERSION {
            return Err(BatchError::BadMagic("token"));
        }
        let batch_id = r.u64()?;
        let rows = r.u32()? as usize;
        let seq_len = r.u32()?;
        read_tokens(&mut r, batch_id, rows, seq_len)
    }
}

fn token_section_len(rows: usize, seq_len: usize) -> usize {
    rows * 4 + rows * seq_len * 5
}

fn read_tokens(
    r: &mut Reader,
    batch_id: u64,
    rows: usize,
    seq_len: u32,
) -> Result<TokenBatch, BatchError> {
    let cells = rows
        .checked_mul(seq_len as usize)
        .ok_or(BatchError::Truncated("size overflow"))?;
    if token_section_len(rows, seq_len as usize) > r.buf.len().saturating_sub(r.pos) {
        return Err(BatchError::Truncated("token section"));
    }
    let lengths: Vec<u32> = (0..rows).map(|_| r.u32()).collect::<Result<_, _>>()?;
    if let Some(&bad) = lengths.iter().find(|&&l| l > seq_len || l == 0) {
        return Err(BatchError::Inconsistent(format!(
            "row length {bad} outside 1..={seq_len}"
        )));
    }
    let input_ids = (0..cells).map(|_| r.u32()).collect::<Result<_, _>>()?;
    let loss_mask = r.take(cells, "loss mask")?.to_vec();
    Ok(TokenBatch {
        batch_id,
        seq_len,
        lengths,
        input_ids,
        loss_mask,
    })
}

/// What the hidden states are: which layers of which target, in what shape. A drafter
/// refuses batches whose spec differs from the one it trains with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaptureSpec {
    /// Decoder layers tapped (output of layer id, i.e. HF hidden_states[id + 1]).
    pub tap_ids: Vec<u32>,
    pub hidden: u32,
    pub dtype: u32,
    /// Fingerprint of the target model (config and weights identity).
    pub target: u64,
}

/// In words, for logs: "taps [1, 2], hidden 64, bf16, target 00ab12cd34ef5678".
impl std::fmt::Display for CaptureSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "taps {:?}, hidden {}, ", self.tap_ids, self.hidden)?;
        if self.dtype == DTYPE_BF16 {
            write!(f, "bf16")?;
        } else {
            write!(f, "dtype code {}", self.dtype)?;
        }
        write!(f, ", target {:016x}", self.target)
    }
}

impl CaptureSpec {
    /// Bytes of hidden states per token.
    pub fn bytes_per_token(&self) -> u64 {
        self.tap_ids.len() as u64 * self.hidden as u64 * 2
    }

    /// Largest hidden-state batch for a token budget (rows × padded length ≤ budget).
    pub fn max_batch_bytes(&self, token_budget: u64) -> u64 {
        HiddenLayout::header_len(self.tap_ids.len()) as u64
            + token_budget * 4
            + token_budget * 5
            + token_budget * self.bytes_per_token()
            + 8
    }
}

/// Offsets of a hidden-state batch of a given shape.
pub struct HiddenLayout {
    pub hidden_offset: usize,
    pub hidden_len: usize,
    pub total: usize,
}

impl HiddenLayout {
    fn header_len(n_taps: usize) -> usize {
        4 + 4 + 8 + 4 * 5 + 8 + 4 * n_taps
    }

    pub fn new(spec: &CaptureSpec, rows: usize, seq_len: usize) -> HiddenLayout {
        let hidden_offset = Self::header_len(spec.tap_ids.len()) + token_section_len(rows, seq_len);
        let hidden_len = rows * seq_len * spec.bytes_per_token() as usize;
        HiddenLayout {
            hidden_offset,
            hidden_len,
            total: hidden_offset + hidden_len + 8,
        }
    }
}

/// Write the header and tokens of a hidden-state batch for `tokens`; the caller then fills
/// `buf[layout.hidden_offset..][..layout.hidden_len]` and calls [`seal_hidden`].
pub fn write_hidden_header(
    buf: &mut [u8],
    spec: &CaptureSpec,
    tokens: &TokenBatch,
) -> Result<HiddenLayout, BatchError> {
    let layout = HiddenLayout::new(spec, tokens.rows(), tokens.seq_len as usize);
    if layout.total > buf.len() {
        return Err(BatchError::TooBig {
            need: layout.total,
            have: buf.len(),
        });
    }
    let mut w = Writer { buf, pos: 0 };
    w.bytes(HIDDEN_MAGIC);
    w.u32(VERSION);
    w.u64(tokens.batch_id);
    w.u32(tokens.rows() as u32);
    w.u32(tokens.seq_len);
    w.u32(spec.tap_ids.len() as u32);
    w.u32(spec.hidden);
    w.u32(spec.dtype);
    w.u64(spec.target);
    for &t in &spec.tap_ids {
        w.u32(t);
    }
    tokens.write_tokens(&mut w);
    debug_assert_eq!(w.pos, layout.hidden_offset);
    Ok(layout)
}

/// Store the checksum of the hidden states; returns the batch's total length.
pub fn seal_hidden(buf: &mut [u8], layout: &HiddenLayout) -> usize {
    let sum = checksum(&buf[layout.hidden_offset..layout.hidden_offset + layout.hidden_len]);
    let end = layout.hidden_offset + layout.hidden_len;
    buf[end..end + 8].copy_from_slice(&sum.to_le_bytes());
    layout.total
}

/// A verified hidden-state batch, borrowed from its slot.
pub struct HiddenView<'a> {
    pub spec: CaptureSpec,
    pub tokens: TokenBatch,
    pub hidden: &'a [u8],
}

impl<'a> HiddenView<'a> {
    /// Parse and verify (shape, lengths, checksum) a batch of `len` bytes.
    pub fn parse(buf: &'a [u8]) -> Result<HiddenView<'a>, BatchError> {
        let mut r = Reader { buf, pos: 0 };
        if r.take(4, "magic")? != HIDDEN_MAGIC || r.u32()? != VERSION {
            return Err(BatchError::BadMagic("hidden-state"));
        }
        let batch_id = r.u64()?;
        let rows = r.u32()? as usize;
        let seq_len = r.u32()?;
        let n_taps = r.u32()? as usize;
        let hidden = r.u32()?;
        let dtype = r.u32()?;
        let target = r.u64()?;
        if n_taps > 1024 {
            return Err(BatchError::Inconsistent(format!("{n_taps} taps")));
        }
        let tap_ids = (0..n_taps).map(|_| r.u32()).collect::<Result<_, _>>()?;
        let spec = CaptureSpec {
            tap_ids,
            hidden,
            dtype,
            target,
        };
        let tokens = read_tokens(&mut r, batch_id, rows, seq_len)?;
        let layout = HiddenLayout::new(&spec, rows, seq_len as usize);
        let data = r.take(layout.hidden_len, "hidden states")?;
        let stored = r.u64()?;
        if checksum(data) != stored {
            return Err(BatchError::Checksum);
        }
        Ok(HiddenView {
            spec,
            tokens,
            hidden: data,
        })
    }
}

/// A fast 64-bit checksum (word-wise multiply-xor): catches torn or stray writes, not an
/// adversary.
pub fn checksum(data: &[u8]) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut h = data.len() as u64 ^ K;
    let mut chunks = data.chunks_exact(8);
    for c in &mut chunks {
        let v = u64::from_le_bytes(c.try_into().expect("8 bytes"));
        h = (h ^ v).wrapping_mul(K).rotate_left(29);
    }
    for &b in chunks.remainder() {
        h = (h ^ b as u64).wrapping_mul(K);
    }
    h
}

struct Writer<'a> {
    buf: &'a mut [u8],
    pos: usize,
}

impl Writer<'_> {
    fn bytes(&mut self, b: &[u8]) {
        self.buf[self.pos..self.pos + b.len()].copy_from_slice(b);
        self.pos += b.len();
    }
    fn u32(&mut self, v: u32) {
        self.bytes(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], BatchError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or(BatchError::Truncated(what))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, BatchError> {
        Ok(u32::from_le_bytes(
            self.take(4, "u32")?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, BatchError> {
        Ok(u64::from_le_bytes(
            self.take(8, "u64")?.try_into().expect("8 bytes"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tb() -> TokenBatch {
        TokenBatch {
            batch_id: 42,
            seq_len: 3,
            lengths: vec![3, 2],
            input_ids: vec![1, 2, 3, 4, 5, 0],
            loss_mask: vec![0, 1, 1, 1, 1, 0],
        }
    }

    #[test]
    fn token_batch_round_trip_and_truncation() {
        let b = tb();
        let mut buf = vec![0u8; 256];
        let n = b.encode_into(&mut buf).unwrap();
        assert_eq!(n, b.encoded_len());
        assert_eq!(TokenBatch::decode(&buf[..n]).unwrap(), b);
        assert!(matches!(
            TokenBatch::decode(&buf[..n - 1]),
            Err(BatchError::Truncated(_))
        ));
        assert!(matches!(
            b.encode_into(&mut [0u8; 10]),
            Err(BatchError::TooBig { .. })
        ));
        buf[0] = b'X';
        assert_eq!(
            TokenBatch::decode(&buf[..n]),
            Err(BatchError::BadMagic("token"))
        );
    }

    #[test]
    fn hidden_batch_round_trip_and_corruption() {
        let spec = CaptureSpec {
            tap_ids: vec![1, 3],
            hidden: 4,
            dtype: DTYPE_BF16,
            target: 7,
        };
        let b = tb();
        let mut buf = vec![0u8; spec.max_batch_bytes(6) as usize];
        let layout = write_hidden_header(&mut buf, &spec, &b).unwrap();
        assert_eq!(layout.hidden_len, 6 * 2 * 4 * 2);
        for (i, x) in buf[layout.hidden_offset..][..layout.hidden_len]
            .iter_mut()
            .enumerate()
        {
            *x = i as u8;
        }
        let n = seal_hidden(&mut buf, &layout);
        assert!(n <= buf.len());
        let v = HiddenView::parse(&buf[..n]).unwrap();
        assert_eq!(v.spec, spec);
        assert_eq!(v.tokens, b);
        assert_eq!(v.hidden.len(), layout.hidden_len);
        buf[layout.hidden_offset + 5] ^= 1;
        assert!(matches!(
            HiddenView::parse(&buf[..n]),
            Err(BatchError::Checksum)
        ));
    }
}
