//! The item codec: how one cached item is laid out as a payload. No pyo3 here; the Python
//! side (walking Python objects, building tensors and arrays) is `python/encode.rs` and
//! `python/decode.rs`.
//!
//! A payload is *parts*, each starting at the next multiple of [`ALIGN`](crate::layout::ALIGN)
//! bytes from the payload start (the store's rule, [`part_offsets`]): part 0 is the header,
//! parts 1..=n are the raw bytes of the item's tensors, arrays and long `bytes` values, so a
//! reader can view every one of them in place.
//!
//! ```text
//! part 0, all integers little-endian:
//! 0     4   magic b"MMC" + format version digit (b"MMC2")
//! 4     4   u32  header length: bytes of part 0, these 16 included
//! 8     4   u32  n, the number of parts after part 0
//! 12    4   u32  flags, 0 (reserved)
//! 16    8n  u64  length of part 1, ..., part n
//! 16+8n     the value tree: one node per value, depth first; the root is a dict
//! ```
//!
//! A node is a tag byte and what the tag says follows:
//!
//! ```text
//! 0 None  1 False  2 True
//! 3 int     i64                 4 int in [2^63, 2^64)  u64     5 float  f64
//! 6 str     u32 len, UTF-8      7 bytes  u32 len, bytes        8 bytes in a part: u32 part
//! 9 list    u32 count, nodes    10 tuple (as list)             11 dict: u32 count, then per
//!                                                                 entry u32 len, UTF-8 key, node
//! 12 tensor u8 len, dtype name (torch's, e.g. "bfloat16"), u8 ndim, ndim x u64, u32 part
//! 13 array  u8 len, dtype descriptor (numpy's dtype.str, e.g. "<f4"), u8 ndim, dims, u32 part
//! 14 scalar u8 len, dtype descriptor, u32 len, the value's raw bytes (a numpy scalar)
//! ```
//!
//! A numpy descriptor is the dtype's `dtype.str`, or, where that reads back as another scalar
//! type of the same dtype (longlong's "<i8" is int64's on LP64), its byte order and
//! character code ("<q").
//!
//! Part numbers count from 1 (part 0 is the header), and every part belongs to exactly one
//! node: as the parts lie one after another inside the payload, the values a payload decodes
//! into hold at most the payload's own bytes (plus one small object per node of the header),
//! whatever its header says. Anything else — another magic or version, a count the remaining
//! bytes cannot hold, a part number out of range, a part named by two nodes or by none, parts
//! running past the payload, invalid UTF-8, trailing bytes — is a [`FormatError`]. Whether a
//! tensor's or array's part holds exactly `numel * itemsize` bytes is checked by the Python
//! side, which knows the item sizes.

use std::fmt;

use crate::layout::part_offsets;

/// The first three bytes of every payload; the fourth is the format version digit.
pub const MAGIC: &[u8; 3] = b"MMC";
/// The payload format this build writes and reads (version 1 was a msgpack header).
pub const FORMAT_VERSION: u8 = 2;
/// Bytes before the part table.
pub const PREFIX_LEN: usize = 16;
/// `bytes` values at least this long travel as their own part instead of in the header.
pub const OUT_OF_BAND_BYTES: usize = 256;
/// Deepest nesting of lists, tuples and dicts an item may have (the root dict is level 1).
pub const MAX_DEPTH: usize = 64;
/// Most dimensions a tensor or array may have.
pub const MAX_NDIM: usize = 64;

const NONE: u8 = 0;
const FALSE: u8 = 1;
const TRUE: u8 = 2;
const INT: u8 = 3;
const UINT: u8 = 4;
const FLOAT: u8 = 5;
const STR: u8 = 6;
const BYTES: u8 = 7;
const BYTES_PART: u8 = 8;
const LIST: u8 = 9;
const TUPLE: u8 = 10;
const DICT: u8 = 11;
const TENSOR: u8 = 12;
const ARRAY: u8 = 13;
const SCALAR: u8 = 14;

/// A payload that is not a valid encoding, or a value the format cannot hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FormatError(pub String);

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for FormatError {}

pub type Result<T> = std::result::Result<T, FormatError>;

fn err<T>(msg: impl Into<String>) -> Result<T> {
    Err(FormatError(msg.into()))
}

/// A length as the format's `u32`.
fn len32(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n).or_else(|_| err(format!("{what} of {n} bytes is longer than 4 GiB")))
}

/// The container kinds of the tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Container {
    List,
    Tuple,
    Dict,
}

/// An open container in a [`HeaderBuilder`]: where its count goes.
#[derive(Debug)]
#[must_use = "close the container with HeaderBuilder::end"]
pub struct Open(usize);

/// Writes part 0 of one item, node by node, while the caller collects the parts.
#[derive(Debug, Default)]
pub struct HeaderBuilder {
    tree: Vec<u8>,
    part_lens: Vec<u64>,
}

/// Bytes of tree a [`HeaderBuilder`] starts with room for: a few fields, with no regrowth.
const TREE_CAPACITY: usize = 256;

impl HeaderBuilder {
    pub fn new() -> Self {
        HeaderBuilder {
            tree: Vec::with_capacity(TREE_CAPACITY),
            part_lens: Vec::new(),
        }
    }

    fn tag(&mut self, tag: u8) {
        self.tree.push(tag);
    }

    fn u32(&mut self, v: u32) {
        self.tree.extend_from_slice(&v.to_le_bytes());
    }

    /// A new part of `len` bytes; its number (the caller supplies the bytes in this order).
    fn part(&mut self, len: u64) -> Result<u32> {
        self.part_lens.push(len);
        len32(self.part_lens.len(), "the part count")
    }

    /// A short string: a `u8` length and the bytes (dtype names and descriptors).
    fn short(&mut self, s: &str) -> Result<()> {
        let n = u8::try_from(s.len()).or_else(|_| err(format!("dtype name {s:?} is too long")))?;
        self.tree.push(n);
        self.tree.extend_from_slice(s.as_bytes());
        Ok(())
    }

    fn shape(&mut self, shape: &[u64]) -> Result<()> {
        if shape.len() > MAX_NDIM {
            return err(format!(
                "{} dimensions; at most {MAX_NDIM} are supported",
                shape.len()
            ));
        }
        self.tree.push(shape.len() as u8);
        for d in shape {
            self.tree.extend_from_slice(&d.to_le_bytes());
        }
        Ok(())
    }

    pub fn none(&mut self) {
        self.tag(NONE);
    }

    pub fn bool(&mut self, v: bool) {
        self.tag(if v { TRUE } else { FALSE });
    }

    pub fn int(&mut self, v: i64) {
        self.tag(INT);
        self.tree.extend_from_slice(&v.to_le_bytes());
    }

    /// An integer above `i64::MAX` (smaller ones are written with [`Self::int`]).
    pub fn uint(&mut self, v: u64) {
        self.tag(UINT);
        self.tree.extend_from_slice(&v.to_le_bytes());
    }

    pub fn float(&mut self, v: f64) {
        self.tag(FLOAT);
        self.tree.extend_from_slice(&v.to_le_bytes());
    }

    pub fn str(&mut self, s: &str) -> Result<()> {
        let n = len32(s.len(), "a str")?;
        self.tag(STR);
        self.u32(n);
        self.tree.extend_from_slice(s.as_bytes());
        Ok(())
    }

    /// A `bytes` value: inline when short (`None`), else a new part whose number is returned
    /// (the caller then supplies `value` as that part).
    pub fn bytes(&mut self, value: &[u8]) -> Result<Option<u32>> {
        if value.len() < OUT_OF_BAND_BYTES {
            self.tag(BYTES);
            self.u32(value.len() as u32);
            self.tree.extend_from_slice(value);
            return Ok(None);
        }
        let part = self.part(value.len() as u64)?;
        self.tag(BYTES_PART);
        self.u32(part);
        Ok(Some(part))
    }

    /// Open a container; its children follow, then [`Self::end`] with how many there were
    /// (for a dict, each child is a [`Self::key`] and a value).
    pub fn begin(&mut self, kind: Container) -> Open {
        self.tag(match kind {
            Container::List => LIST,
            Container::Tuple => TUPLE,
            Container::Dict => DICT,
        });
        let at = self.tree.len();
        self.u32(0);
        Open(at)
    }

    pub fn end(&mut self, open: Open, count: usize) -> Result<()> {
        let n = len32(count, "a container")?;
        self.tree[open.0..open.0 + 4].copy_from_slice(&n.to_le_bytes());
        Ok(())
    }

    pub fn key(&mut self, key: &str) -> Result<()> {
        self.u32(len32(key.len(), "a key")?);
        self.tree.extend_from_slice(key.as_bytes());
        Ok(())
    }

    /// A tensor whose `nbytes` raw bytes become a new part; returns the part's number.
    pub fn tensor(&mut self, dtype: &str, shape: &[u64], nbytes: u64) -> Result<u32> {
        self.strided(TENSOR, dtype, shape, nbytes)
    }

    /// A numpy array (`descr` is its dtype's descriptor); returns the new part's number.
    pub fn array(&mut self, descr: &str, shape: &[u64], nbytes: u64) -> Result<u32> {
        self.strided(ARRAY, descr, shape, nbytes)
    }

    fn strided(&mut self, tag: u8, dtype: &str, shape: &[u64], nbytes: u64) -> Result<u32> {
        self.tag(tag);
        self.short(dtype)?;
        self.shape(shape)?;
        let part = self.part(nbytes)?;
        self.u32(part);
        Ok(part)
    }

    /// A numpy scalar: its dtype descriptor and raw bytes, inline.
    pub fn scalar(&mut self, descr: &str, raw: &[u8]) -> Result<()> {
        self.tag(SCALAR);
        self.short(descr)?;
        self.u32(len32(raw.len(), "a scalar")?);
        self.tree.extend_from_slice(raw);
        Ok(())
    }

    /// The lengths of the parts announced so far (part 1 first).
    pub fn part_lens(&self) -> &[u64] {
        &self.part_lens
    }

    /// Part 0: the prefix, the part table and the tree.
    pub fn finish(self) -> Result<Vec<u8>> {
        let len = PREFIX_LEN + 8 * self.part_lens.len() + self.tree.len();
        let header_len = len32(len, "the header")?;
        let mut out = Vec::with_capacity(len);
        out.extend_from_slice(MAGIC);
        out.push(b'0' + FORMAT_VERSION);
        out.extend_from_slice(&header_len.to_le_bytes());
        out.extend_from_slice(&(self.part_lens.len() as u32).to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        for n in &self.part_lens {
            out.extend_from_slice(&n.to_le_bytes());
        }
        out.extend_from_slice(&self.tree);
        Ok(out)
    }
}

/// Bytes the store keeps for a payload of part 0 (`header_len` bytes) and parts of these
/// lengths, padding included.
pub fn payload_len(header_len: u64, part_lens: &[u64]) -> Option<u64> {
    part_offsets(std::iter::once(header_len).chain(part_lens.iter().copied())).map(|(_, end)| end)
}

/// The length of part 0, read from the first [`PREFIX_LEN`] bytes of a payload.
pub fn header_len(prefix: &[u8; PREFIX_LEN]) -> Result<usize> {
    if &prefix[..3] != MAGIC {
        return err(format!(
            "bad magic {:?}",
            String::from_utf8_lossy(&prefix[..4])
        ));
    }
    if prefix[3] != b'0' + FORMAT_VERSION {
        return err(format!(
            "payload format version {:?}, this build reads version {FORMAT_VERSION} (the writer \
             runs another mmcache version)",
            prefix[3] as char
        ));
    }
    let [_, _, _, _, l0, l1, l2, l3, ..] = *prefix;
    let header_len = u32::from_le_bytes([l0, l1, l2, l3]) as usize;
    if header_len < PREFIX_LEN {
        return err(format!(
            "header length {header_len} is shorter than its prefix"
        ));
    }
    Ok(header_len)
}

/// A parsed part 0: where each part lies in the payload, and the value tree.
#[derive(Debug)]
pub struct Header<'a> {
    /// `(offset, len)` of parts 1..=n within the payload.
    pub parts: Vec<(u64, u64)>,
    tree: &'a [u8],
}

impl<'a> Header<'a> {
    /// Parse part 0 (`header`, all of it) of a payload of `payload_len` bytes.
    pub fn parse(header: &'a [u8], payload_len: u64) -> Result<Header<'a>> {
        let prefix: &[u8; PREFIX_LEN] = header
            .get(..PREFIX_LEN)
            .and_then(|p| p.try_into().ok())
            .ok_or_else(|| FormatError(format!("{} bytes cannot hold a header", header.len())))?;
        if header_len(prefix)? != header.len() {
            return err("the header length does not match part 0");
        }
        let [.., n0, n1, n2, n3, f0, f1, f2, f3] = *prefix;
        let n = u32::from_le_bytes([n0, n1, n2, n3]) as usize;
        if [f0, f1, f2, f3] != [0; 4] {
            return err("unknown header flags");
        }
        let table_end = n
            .checked_mul(8)
            .and_then(|t| t.checked_add(PREFIX_LEN))
            .filter(|&end| end <= header.len())
            .ok_or_else(|| FormatError(format!("the header cannot hold a table of {n} parts")))?;
        let lens: Vec<u64> = le_u64s(&header[PREFIX_LEN..table_end]).collect();
        let all = std::iter::once(header.len() as u64).chain(lens.iter().copied());
        let (offsets, _) = part_offsets(all)
            .filter(|(_, end)| *end <= payload_len)
            .ok_or_else(|| FormatError("the parts run past the end of the payload".into()))?;
        Ok(Header {
            parts: offsets.into_iter().skip(1).zip(lens).collect(),
            tree: &header[table_end..],
        })
    }

    /// Check the whole tree — a dict at the root, nesting at most [`MAX_DEPTH`] deep, every
    /// node readable, every part named by exactly one node, nothing after the root — calling
    /// `visit` on every node, depth first.
    pub fn walk(&self, mut visit: impl FnMut(&Node<'a>) -> Result<()>) -> Result<()> {
        let mut named = vec![false; self.parts.len()];
        let mut visit = |node: &Node<'a>| {
            if let Some(part) = node.part() {
                if std::mem::replace(&mut named[part], true) {
                    return err(format!("part {} is named by two values", part + 1));
                }
            }
            visit(node)
        };
        let mut r = self.tree();
        let root = r.node()?;
        let Node::Dict(n) = root else {
            return err("the root is not a dict");
        };
        visit(&root)?;
        // Per open container: children still to read, and whether they are dict entries.
        let mut open = vec![(n, true)];
        while let Some(top) = open.last_mut() {
            if top.0 == 0 {
                open.pop();
                continue;
            }
            top.0 -= 1;
            let entries = top.1;
            if entries {
                r.key()?;
            }
            let node = r.node()?;
            visit(&node)?;
            let children = match node {
                Node::List(n) | Node::Tuple(n) => Some((n, false)),
                Node::Dict(n) => Some((n, true)),
                _ => None,
            };
            if let Some(children) = children {
                if open.len() >= MAX_DEPTH {
                    return err(format!("containers nested deeper than {MAX_DEPTH} levels"));
                }
                open.push(children);
            }
        }
        r.finish()?;
        match named.iter().position(|&n| !n) {
            Some(part) => err(format!("part {} is named by no value", part + 1)),
            None => Ok(()),
        }
    }

    /// A reader of the value tree, positioned at the root.
    pub fn tree(&self) -> TreeReader<'a> {
        TreeReader {
            buf: self.tree,
            pos: 0,
            parts: self.parts.len(),
        }
    }
}

/// The little-endian `u64`s in `bytes` (a trailing partial word is ignored).
fn le_u64s(bytes: &[u8]) -> impl ExactSizeIterator<Item = u64> + '_ {
    bytes
        .chunks_exact(8)
        .map(|word| word.iter().rev().fold(0, |n, &b| (n << 8) | u64::from(b)))
}

/// A tensor's or array's dimensions, as stored (little-endian `u64`s).
#[derive(Debug, Clone, Copy)]
pub struct Shape<'a>(&'a [u8]);

impl<'a> Shape<'a> {
    pub fn dims(&self) -> impl ExactSizeIterator<Item = u64> + 'a {
        le_u64s(self.0)
    }

    /// The number of elements, if it fits a `u64`.
    pub fn numel(&self) -> Option<u64> {
        self.dims().try_fold(1u64, |n, d| n.checked_mul(d))
    }
}

/// One node of the tree. Part numbers are turned into indices into [`Header::parts`].
#[derive(Debug, Clone, Copy)]
pub enum Node<'a> {
    None,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    Str(&'a str),
    Bytes(&'a [u8]),
    BytesPart(usize),
    /// A container and how many children (dict: entries) follow.
    List(usize),
    Tuple(usize),
    Dict(usize),
    Tensor {
        dtype: &'a str,
        shape: Shape<'a>,
        part: usize,
    },
    Array {
        descr: &'a str,
        shape: Shape<'a>,
        part: usize,
    },
    Scalar {
        descr: &'a str,
        raw: &'a [u8],
    },
}

impl Node<'_> {
    /// The index of the part this node's bytes are in, if they are in one.
    pub fn part(&self) -> Option<usize> {
        match *self {
            Node::BytesPart(part) | Node::Tensor { part, .. } | Node::Array { part, .. } => {
                Some(part)
            }
            _ => None,
        }
    }
}

/// Reads the tree node by node; every read is bounds-checked.
#[derive(Debug)]
pub struct TreeReader<'a> {
    buf: &'a [u8],
    pos: usize,
    parts: usize,
}

impl<'a> TreeReader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.buf.len())
            .ok_or_else(|| FormatError("the value tree is truncated".into()))?;
        let out = &self.buf[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        self.take(N)?
            .try_into()
            .or_else(|_| err("the value tree is truncated"))
    }

    fn u32(&mut self) -> Result<usize> {
        Ok(u32::from_le_bytes(self.array()?) as usize)
    }

    fn utf8(&mut self, n: usize) -> Result<&'a str> {
        std::str::from_utf8(self.take(n)?).or_else(|_| err("a string is not valid UTF-8"))
    }

    fn short(&mut self) -> Result<&'a str> {
        let n = self.array::<1>()?[0] as usize;
        self.utf8(n)
    }

    fn part(&mut self) -> Result<usize> {
        match self.u32()? {
            p if (1..=self.parts).contains(&p) => Ok(p - 1),
            p => err(format!("part {p} does not exist ({} parts)", self.parts)),
        }
    }

    /// A container's count, refused if the rest of the tree cannot hold that many children.
    fn count(&mut self, min_child: usize) -> Result<usize> {
        let n = self.u32()?;
        if n.saturating_mul(min_child) > self.buf.len() - self.pos {
            return err(format!(
                "a container claims {n} children the tree cannot hold"
            ));
        }
        Ok(n)
    }

    fn shape(&mut self) -> Result<Shape<'a>> {
        let ndim = self.array::<1>()?[0] as usize;
        if ndim > MAX_NDIM {
            return err(format!("{ndim} dimensions (at most {MAX_NDIM})"));
        }
        Ok(Shape(self.take(8 * ndim)?))
    }

    /// The next node.
    pub fn node(&mut self) -> Result<Node<'a>> {
        let [tag] = self.array()?;
        Ok(match tag {
            NONE => Node::None,
            FALSE => Node::Bool(false),
            TRUE => Node::Bool(true),
            INT => Node::Int(i64::from_le_bytes(self.array()?)),
            UINT => Node::UInt(u64::from_le_bytes(self.array()?)),
            FLOAT => Node::Float(f64::from_le_bytes(self.array()?)),
            STR => {
                let n = self.u32()?;
                Node::Str(self.utf8(n)?)
            }
            BYTES => {
                let n = self.u32()?;
                Node::Bytes(self.take(n)?)
            }
            BYTES_PART => Node::BytesPart(self.part()?),
            LIST => Node::List(self.count(1)?),
            TUPLE => Node::Tuple(self.count(1)?),
            DICT => Node::Dict(self.count(5)?),
            TENSOR => Node::Tensor {
                dtype: self.short()?,
                shape: self.shape()?,
                part: self.part()?,
            },
            ARRAY => Node::Array {
                descr: self.short()?,
                shape: self.shape()?,
                part: self.part()?,
            },
            SCALAR => {
                let descr = self.short()?;
                let n = self.u32()?;
                Node::Scalar {
                    descr,
                    raw: self.take(n)?,
                }
            }
            other => return err(format!("unknown node tag {other}")),
        })
    }

    /// A dict entry's key (before its value's node).
    pub fn key(&mut self) -> Result<&'a str> {
        let n = self.u32()?;
        self.utf8(n)
    }

    /// Refuse bytes after the root.
    pub fn finish(self) -> Result<()> {
        if self.pos != self.buf.len() {
            return err(format!(
                "{} bytes after the value tree",
                self.buf.len() - self.pos
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
