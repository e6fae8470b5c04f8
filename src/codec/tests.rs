//! The codec against a model: any tree of values round trips through a payload, and no
//! byte string makes the reader panic.

use proptest::prelude::*;

use super::*;

/// A decoded value tree; parts are carried inline so a round trip compares them too.
#[derive(Debug, Clone, PartialEq)]
enum Value {
    None,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(u64), // the bits, so NaN payloads compare
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<Value>),
    Tuple(Vec<Value>),
    Dict(Vec<(String, Value)>),
    Tensor(String, Vec<u64>, Vec<u8>),
    Array(String, Vec<u64>, Vec<u8>),
    Scalar(String, Vec<u8>),
}

fn encode(v: &Value, b: &mut HeaderBuilder, parts: &mut Vec<Vec<u8>>) -> Result<()> {
    match v {
        Value::None => b.none(),
        Value::Bool(x) => b.bool(*x),
        Value::Int(x) => b.int(*x),
        Value::UInt(x) => b.uint(*x),
        Value::Float(bits) => b.float(f64::from_bits(*bits)),
        Value::Str(s) => b.str(s)?,
        Value::Bytes(x) => {
            if b.bytes(x)?.is_some() {
                parts.push(x.clone());
            }
        }
        Value::List(xs) | Value::Tuple(xs) => {
            let kind = if matches!(v, Value::List(_)) {
                Container::List
            } else {
                Container::Tuple
            };
            let open = b.begin(kind);
            for x in xs {
                encode(x, b, parts)?;
            }
            b.end(open, xs.len())?;
        }
        Value::Dict(entries) => {
            let open = b.begin(Container::Dict);
            for (k, x) in entries {
                b.key(k)?;
                encode(x, b, parts)?;
            }
            b.end(open, entries.len())?;
        }
        Value::Tensor(dtype, shape, data) => {
            let part = b.tensor(dtype, shape, data.len() as u64)?;
            assert_eq!(part as usize, parts.len() + 1);
            parts.push(data.clone());
        }
        Value::Array(descr, shape, data) => {
            b.array(descr, shape, data.len() as u64)?;
            parts.push(data.clone());
        }
        Value::Scalar(descr, raw) => b.scalar(descr, raw)?,
    }
    Ok(())
}

/// The payload the store would hold: every part at its aligned offset, zero padding.
fn payload(root: &Value) -> Vec<u8> {
    let mut b = HeaderBuilder::new();
    let mut parts = Vec::new();
    encode(root, &mut b, &mut parts).unwrap();
    assert_eq!(
        b.part_lens(),
        parts.iter().map(|p| p.len() as u64).collect::<Vec<_>>()
    );
    let header = b.finish().unwrap();
    let all: Vec<&[u8]> = std::iter::once(header.as_slice())
        .chain(parts.iter().map(Vec::as_slice))
        .collect();
    let (offsets, end) = part_offsets(all.iter().map(|p| p.len() as u64)).unwrap();
    let lens: Vec<u64> = parts.iter().map(|p| p.len() as u64).collect();
    assert_eq!(payload_len(header.len() as u64, &lens), Some(end));
    let mut out = vec![0u8; end as usize];
    for (part, offset) in all.iter().zip(offsets) {
        out[offset as usize..offset as usize + part.len()].copy_from_slice(part);
    }
    out
}

fn decode(payload: &[u8]) -> Result<Value> {
    let prefix: &[u8; PREFIX_LEN] = payload
        .get(..PREFIX_LEN)
        .and_then(|p| p.try_into().ok())
        .ok_or_else(|| FormatError("short".into()))?;
    let header = payload
        .get(..header_len(prefix)?)
        .ok_or_else(|| FormatError("short header".into()))?;
    let parsed = Header::parse(header, payload.len() as u64)?;
    let mut nodes = 0;
    parsed.walk(|_| {
        nodes += 1;
        Ok(())
    })?;
    assert!(nodes > 0);
    let part = |i: usize| {
        let (offset, len) = parsed.parts[i];
        payload[offset as usize..(offset + len) as usize].to_vec()
    };
    // `walk` validated the tree: this second pass only builds it.
    fn node(r: &mut TreeReader<'_>, part: &dyn Fn(usize) -> Vec<u8>) -> Result<Value> {
        let children =
            |r: &mut TreeReader<'_>, n| (0..n).map(|_| node(r, part)).collect::<Result<Vec<_>>>();
        Ok(match r.node()? {
            Node::None => Value::None,
            Node::Bool(x) => Value::Bool(x),
            Node::Int(x) => Value::Int(x),
            Node::UInt(x) => Value::UInt(x),
            Node::Float(x) => Value::Float(x.to_bits()),
            Node::Str(s) => Value::Str(s.into()),
            Node::Bytes(x) => Value::Bytes(x.into()),
            Node::BytesPart(p) => Value::Bytes(part(p)),
            Node::List(n) => Value::List(children(r, n)?),
            Node::Tuple(n) => Value::Tuple(children(r, n)?),
            Node::Dict(n) => Value::Dict(
                (0..n)
                    .map(|_| Ok((r.key()?.to_owned(), node(r, part)?)))
                    .collect::<Result<_>>()?,
            ),
            Node::Tensor {
                dtype,
                shape,
                part: p,
            } => Value::Tensor(dtype.into(), shape.dims().collect(), part(p)),
            Node::Array {
                descr,
                shape,
                part: p,
            } => Value::Array(descr.into(), shape.dims().collect(), part(p)),
            Node::Scalar { descr, raw } => Value::Scalar(descr.into(), raw.into()),
        })
    }
    let mut reader = parsed.tree();
    let root = node(&mut reader, &part)?;
    reader.finish()?;
    Ok(root)
}

/// The bytes of every value in a decoded tree: parts' and those inline in the header.
fn data_len(v: &Value) -> usize {
    match v {
        Value::Str(s) => s.len(),
        Value::Bytes(b) | Value::Tensor(_, _, b) | Value::Array(_, _, b) | Value::Scalar(_, b) => {
            b.len()
        }
        Value::List(xs) | Value::Tuple(xs) => xs.iter().map(data_len).sum(),
        Value::Dict(entries) => entries.iter().map(|(k, x)| k.len() + data_len(x)).sum(),
        _ => 0,
    }
}

/// A payload whose root dict holds one `u8` tensor per entry of `named`, naming that part
/// (1-based) of the `lens` parts: trees the encoder never writes, as a forger would.
fn naming(lens: &[u64], named: &[u32]) -> Vec<u8> {
    let mut tree = vec![DICT];
    tree.extend_from_slice(&(named.len() as u32).to_le_bytes());
    for &part in named {
        let len = lens
            .get(part.wrapping_sub(1) as usize)
            .copied()
            .unwrap_or(0);
        tree.extend_from_slice(&0u32.to_le_bytes()); // an empty key
        tree.extend_from_slice(&[TENSOR, 2, b'u', b'8', 1]);
        tree.extend_from_slice(&len.to_le_bytes());
        tree.extend_from_slice(&part.to_le_bytes());
    }
    let header_len = PREFIX_LEN + 8 * lens.len() + tree.len();
    let mut out = Vec::new();
    out.extend_from_slice(MAGIC);
    out.push(b'0' + FORMAT_VERSION);
    out.extend_from_slice(&(header_len as u32).to_le_bytes());
    out.extend_from_slice(&(lens.len() as u32).to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    for len in lens {
        out.extend_from_slice(&len.to_le_bytes());
    }
    out.extend_from_slice(&tree);
    out.resize(payload_len(header_len as u64, lens).unwrap() as usize, 0xab);
    out
}

fn leaf() -> impl Strategy<Value = Value> {
    let shape = prop::collection::vec(0u64..4, 0..4);
    prop_oneof![
        Just(Value::None),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::Int),
        ((1u64 << 63)..=u64::MAX).prop_map(Value::UInt),
        any::<u64>().prop_map(Value::Float),
        ".{0,12}".prop_map(Value::Str),
        prop::collection::vec(any::<u8>(), 0..600).prop_map(Value::Bytes),
        (
            "[a-z0-9_]{1,16}",
            shape.clone(),
            prop::collection::vec(any::<u8>(), 0..300)
        )
            .prop_map(|(d, s, b)| Value::Tensor(d, s, b)),
        (
            "[<>|][a-zA-Z][0-9]{1,2}",
            shape,
            prop::collection::vec(any::<u8>(), 0..300)
        )
            .prop_map(|(d, s, b)| Value::Array(d, s, b)),
        ("[<>|][fiu][248]", prop::collection::vec(any::<u8>(), 0..16))
            .prop_map(|(d, b)| Value::Scalar(d, b)),
    ]
}

fn tree() -> impl Strategy<Value = Value> {
    let inner = leaf().prop_recursive(5, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::List),
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Tuple),
            prop::collection::vec((".{0,8}", inner), 0..6).prop_map(Value::Dict),
        ]
    });
    prop::collection::vec((".{0,8}", inner), 0..6).prop_map(Value::Dict)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn any_tree_round_trips(root in tree()) {
        let bytes = payload(&root);
        prop_assert_eq!(decode(&bytes)?, root);
    }

    #[test]
    fn parts_are_aligned_and_hold_their_bytes(root in tree()) {
        let bytes = payload(&root);
        let header = &bytes[..header_len(bytes[..PREFIX_LEN].try_into().unwrap())?];
        for (offset, _) in Header::parse(header, bytes.len() as u64)?.parts {
            prop_assert_eq!(offset % crate::layout::ALIGN, 0);
        }
    }

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode(&bytes);
    }

    #[test]
    fn mangled_payloads_never_panic(
        root in tree(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = payload(&root);
        for (at, byte) in flips {
            let i = at.index(bytes.len());
            bytes[i] = byte;
        }
        for bytes in [&bytes[..], &bytes[..cut.index(bytes.len() + 1)]] {
            if let Ok(root) = decode(bytes) {
                prop_assert!(data_len(&root) <= bytes.len());
            }
        }
    }

    /// However the nodes name the parts, a payload decodes only if each part is named by
    /// exactly one node, and never into more bytes than it holds.
    #[test]
    fn a_payload_decodes_only_if_each_part_is_named_once(
        lens in prop::collection::vec(0u64..200, 1..5),
        named in prop::collection::vec(1u32..6, 0..8),
    ) {
        let bytes = naming(&lens, &named);
        let mut sorted = named.clone();
        sorted.sort_unstable();
        let once = sorted == (1..=lens.len() as u32).collect::<Vec<_>>();
        match decode(&bytes) {
            Ok(root) => {
                prop_assert!(once, "{named:?} of {} parts decoded", lens.len());
                prop_assert!(data_len(&root) <= bytes.len());
            }
            Err(e) => prop_assert!(!once, "{e}"),
        }
    }

    #[test]
    fn truncated_payloads_are_errors(root in tree(), cut in any::<prop::sample::Index>()) {
        let bytes = payload(&root);
        let keep = cut.index(bytes.len());
        // Part 0 always ends the payload's first part; dropping any byte of the last part or
        // of the header cannot decode.
        prop_assert!(decode(&bytes[..keep]).is_err());
    }
}

fn simple() -> Value {
    Value::Dict(vec![
        (
            "t".into(),
            Value::Tensor("float32".into(), vec![2, 3], vec![7; 24]),
        ),
        (
            "n".into(),
            Value::List(vec![Value::Int(1), Value::Str("x".into())]),
        ),
    ])
}

#[test]
fn the_prefix_names_the_format_and_its_version() {
    let bytes = payload(&simple());
    assert_eq!(&bytes[..4], b"MMC2");
    let mut old = bytes.clone();
    old[3] = b'1';
    let e = decode(&old).unwrap_err();
    assert!(e.0.contains("version '1'"), "{e}");
    let mut foreign = bytes.clone();
    foreign[..3].copy_from_slice(b"PK\x03");
    assert!(decode(&foreign).unwrap_err().0.contains("magic"));
}

#[test]
fn counts_the_tree_cannot_hold_are_refused_before_allocating() {
    let mut b = HeaderBuilder::new();
    let open = b.begin(Container::Dict);
    b.end(open, u32::MAX as usize).unwrap();
    let header = b.finish().unwrap();
    let e = decode(&header).unwrap_err();
    assert!(e.0.contains("cannot hold"), "{e}");
}

#[test]
fn part_numbers_out_of_range_are_refused() {
    let mut bytes = payload(&simple());
    let tree_start = PREFIX_LEN + 8;
    // dict tag, u32 count, u32 key len, "t", tensor tag, u8 len, "float32", u8 ndim, 2 dims,
    // then the tensor's part number.
    let at = tree_start + 1 + 4 + 4 + 1 + 1 + 1 + 7 + 1 + 16;
    assert_eq!(&bytes[at..at + 4], &1u32.to_le_bytes());
    bytes[at..at + 4].copy_from_slice(&2u32.to_le_bytes());
    assert!(
        decode(&bytes)
            .unwrap_err()
            .0
            .contains("part 2 does not exist")
    );
}

#[test]
fn parts_past_the_payload_are_refused() {
    let bytes = payload(&simple());
    let e = decode(&bytes[..bytes.len() - 1]).unwrap_err();
    assert!(e.0.contains("past the end"), "{e}");
}

#[test]
fn limits_are_errors_not_panics() {
    let mut b = HeaderBuilder::new();
    assert!(b.tensor(&"x".repeat(300), &[1], 1).is_err());
    assert!(b.tensor("f", &[1; MAX_NDIM + 1], 1).is_err());
    let mut bytes = payload(&simple());
    bytes.truncate(PREFIX_LEN - 1);
    assert!(decode(&bytes).is_err());
}

#[test]
fn short_bytes_stay_inline_and_long_ones_become_parts() {
    let mut b = HeaderBuilder::new();
    assert_eq!(b.bytes(&[1; OUT_OF_BAND_BYTES - 1]).unwrap(), None);
    assert_eq!(b.bytes(&[1; OUT_OF_BAND_BYTES]).unwrap(), Some(1));
    assert_eq!(b.part_lens(), &[OUT_OF_BAND_BYTES as u64]);
}

fn nested(depth: usize) -> Value {
    (1..depth).fold(Value::Dict(vec![]), |inner, _| {
        Value::Dict(vec![("k".into(), inner)])
    })
}

#[test]
fn walk_refuses_trees_nested_too_deep() {
    assert_eq!(
        decode(&payload(&nested(MAX_DEPTH))).unwrap(),
        nested(MAX_DEPTH)
    );
    let e = decode(&payload(&nested(MAX_DEPTH + 1))).unwrap_err();
    assert!(e.0.contains("deeper than"), "{e}");
}

#[test]
fn walk_refuses_a_root_that_is_not_a_dict() {
    let e = decode(&payload(&Value::List(vec![Value::None]))).unwrap_err();
    assert!(e.0.contains("root is not a dict"), "{e}");
}

#[test]
fn walk_refuses_bytes_after_the_root() {
    let mut b = HeaderBuilder::new();
    let open = b.begin(Container::Dict);
    b.end(open, 0).unwrap();
    b.none();
    let e = decode(&b.finish().unwrap()).unwrap_err();
    assert!(e.0.contains("after the value tree"), "{e}");
}

#[test]
fn a_part_named_by_two_nodes_is_refused() {
    let e = decode(&naming(&[1 << 20], &[1, 1])).unwrap_err();
    assert!(e.0.contains("part 1 is named by two values"), "{e}");
    // Two values can never share the bytes of one, so 64 of them decode into nothing more.
    let e = decode(&naming(&[1 << 20], &[1; 64])).unwrap_err();
    assert!(e.0.contains("named by two"), "{e}");
}

#[test]
fn a_part_named_by_no_node_is_refused() {
    assert!(decode(&naming(&[8, 8], &[2, 1])).is_ok());
    let e = decode(&naming(&[8, 8], &[2])).unwrap_err();
    assert!(e.0.contains("part 1 is named by no value"), "{e}");
}
