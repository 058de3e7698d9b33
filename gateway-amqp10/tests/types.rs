//! The type system: each width decodes, the encoder picks the narrowest, and any value
//! round-trips (proptest); hostile bytes give an error, never a panic.

use bytes::Bytes;
use proptest::prelude::*;
use warren_amqp10::types::{self, DecodeError, Descriptor, Value, decode_value};

fn enc(v: &Value) -> Vec<u8> {
    types::encode(v).expect("encodes").to_vec()
}

#[test]
fn narrowest_forms() {
    assert_eq!(enc(&Value::UInt(0)), [0x43]);
    assert_eq!(enc(&Value::UInt(255)), [0x52, 0xff]);
    assert_eq!(enc(&Value::UInt(256)), [0x70, 0, 0, 1, 0]);
    assert_eq!(enc(&Value::ULong(0)), [0x44]);
    assert_eq!(enc(&Value::ULong(7)), [0x53, 7]);
    assert_eq!(enc(&Value::Int(-1)), [0x54, 0xff]);
    assert_eq!(enc(&Value::Long(-128)), [0x55, 0x80]);
    assert_eq!(enc(&Value::Long(128)), [0x81, 0, 0, 0, 0, 0, 0, 0, 0x80]);
    assert_eq!(enc(&Value::Bool(true)), [0x41]);
    assert_eq!(enc(&Value::List(vec![])), [0x45]);
    assert_eq!(enc(&Value::String("ab".into())), [0xa1, 2, b'a', b'b']);
    let long = "x".repeat(300);
    assert_eq!(
        enc(&Value::Symbol(long.clone()))[..5],
        [0xb3, 0, 0, 1, 0x2c]
    );
    assert_eq!(
        enc(&Value::Array(vec![Value::symbol("a"), Value::symbol("b")])),
        [0xe0, 12, 2, 0xb3, 0, 0, 0, 1, b'a', 0, 0, 0, 1, b'b']
    );
    assert_eq!(
        types::encode(&Value::Array(vec![Value::UInt(1), Value::symbol("b")])),
        Err(types::EncodeError::MixedArray)
    );
}

#[test]
fn every_width_decodes() {
    let cases: &[(&[u8], Value)] = &[
        (&[0x56, 1], Value::Bool(true)),
        (&[0x70, 0, 0, 0, 5], Value::UInt(5)),
        (&[0x80, 0, 0, 0, 0, 0, 0, 0, 5], Value::ULong(5)),
        (&[0x71, 0xff, 0xff, 0xff, 0xfe], Value::Int(-2)),
        (&[0x73, 0, 0, 0, 0x41], Value::Char('A')),
        (
            &[0xb0, 0, 0, 0, 1, 9],
            Value::Binary(Bytes::from_static(&[9])),
        ),
        (&[0xb1, 0, 0, 0, 1, b'z'], Value::String("z".into())),
        (
            &[0xd0, 0, 0, 0, 5, 0, 0, 0, 1, 0x40],
            Value::List(vec![Value::Null]),
        ),
        (
            &[0xc1, 3, 2, 0x43, 0x44],
            Value::Map(vec![(Value::UInt(0), Value::ULong(0))]),
        ),
        (
            &[0xf0, 0, 0, 0, 13, 0, 0, 0, 2, 0x70, 0, 0, 0, 1, 0, 0, 0, 2],
            Value::Array(vec![Value::UInt(1), Value::UInt(2)]),
        ),
        (
            &[0xe0, 5, 2, 0x00, 0x53, 0x24, 0x45],
            Value::Array(vec![
                Value::Described(
                    Box::new(Descriptor::Code(0x24)),
                    Box::new(Value::List(vec![])),
                ),
                Value::Described(
                    Box::new(Descriptor::Code(0x24)),
                    Box::new(Value::List(vec![])),
                ),
            ]),
        ),
    ];
    for (bytes, want) in cases {
        assert_eq!(&decode_value(bytes).expect("decodes"), want, "{bytes:02x?}");
    }
}

#[test]
fn garbage_is_a_typed_error() {
    assert_eq!(decode_value(&[0x99]), Err(DecodeError::UnknownCode(0x99)));
    assert_eq!(
        decode_value(&[0xb1, 0xff, 0xff, 0xff, 0xff]),
        Err(DecodeError::Truncated)
    );
    assert_eq!(decode_value(&[0xa1, 1, 0xff]), Err(DecodeError::Utf8));
    assert_eq!(decode_value(&[0x73, 0, 0, 0xd8, 0]), Err(DecodeError::Char));
    assert_eq!(decode_value(&[0xc1, 2, 1, 0x40]), Err(DecodeError::OddMap));
    assert!(matches!(
        decode_value(&[0xc0, 2, 200, 0x40]),
        Err(DecodeError::Count { .. })
    ));
    assert_eq!(
        decode_value(&[0xc0, 3, 1, 0x40, 0x40]),
        Err(DecodeError::SizeMismatch)
    );
    // 100 lists, each holding the next, sizes all correct: refused for depth alone.
    let mut deep = vec![0x40];
    for _ in 0..100 {
        let mut outer = vec![0xd0];
        outer.extend_from_slice(&(deep.len() as u32 + 4).to_be_bytes());
        outer.extend_from_slice(&1u32.to_be_bytes());
        outer.extend_from_slice(&deep);
        deep = outer;
    }
    assert_eq!(decode_value(&deep), Err(DecodeError::TooDeep));
}

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<u8>().prop_map(Value::UByte),
        any::<u16>().prop_map(Value::UShort),
        any::<u32>().prop_map(Value::UInt),
        any::<u64>().prop_map(Value::ULong),
        any::<i8>().prop_map(Value::Byte),
        any::<i16>().prop_map(Value::Short),
        any::<i32>().prop_map(Value::Int),
        any::<i64>().prop_map(Value::Long),
        // NaN is not equal to itself: finite floats only.
        (-1e30f32..1e30).prop_map(Value::Float),
        (-1e300f64..1e300).prop_map(Value::Double),
        any::<[u8; 4]>().prop_map(Value::Decimal32),
        any::<[u8; 8]>().prop_map(Value::Decimal64),
        any::<[u8; 16]>().prop_map(Value::Decimal128),
        any::<char>().prop_map(Value::Char),
        any::<i64>().prop_map(Value::Timestamp),
        any::<[u8; 16]>().prop_map(Value::Uuid),
        proptest::collection::vec(any::<u8>(), 0..300).prop_map(|b| Value::Binary(b.into())),
        ".{0,40}".prop_map(Value::String),
        "[a-z:-]{0,300}".prop_map(Value::Symbol),
        proptest::collection::vec(any::<u32>(), 1..20)
            .prop_map(|v| Value::Array(v.into_iter().map(Value::UInt).collect())),
        proptest::collection::vec("[a-z]{0,5}", 1..5)
            .prop_map(|v| Value::Array(v.into_iter().map(Value::Symbol).collect())),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(4, 64, 8, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..8).prop_map(Value::List),
            proptest::collection::vec((inner.clone(), inner.clone()), 0..4).prop_map(Value::Map),
            (any::<u64>(), inner.clone()).prop_map(|(c, v)| Value::described(c, v)),
            ("[a-z:]{1,20}", inner.clone())
                .prop_map(|(s, v)| Value::Described(Box::new(Descriptor::Symbol(s)), Box::new(v))),
            // Arrays of lists and of described lists (one constructor, wide element forms).
            proptest::collection::vec(proptest::collection::vec(inner.clone(), 0..4), 1..4)
                .prop_map(|ls| Value::Array(ls.into_iter().map(Value::List).collect())),
            proptest::collection::vec(proptest::collection::vec(inner, 0..4), 1..4).prop_map(
                |ls| Value::Array(
                    ls.into_iter()
                        .map(|l| Value::described(0x24, Value::List(l)))
                        .collect()
                )
            ),
        ]
    })
}

proptest! {
    #[test]
    fn any_value_round_trips(v in value()) {
        let bytes = types::encode(&v).expect("encodes");
        prop_assert_eq!(types::decode(&bytes).expect("decodes"), v);
    }

    #[test]
    fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_value(&data);
        let mut buf = bytes::BytesMut::from(&data[..]);
        while let Ok(Some(f)) = warren_amqp10::frame::decode_frame(&mut buf, 512) {
            let _ = f.body();
        }
    }

    #[test]
    fn truncating_a_value_is_an_error(v in value(), cut in any::<prop::sample::Index>()) {
        let bytes = types::encode(&v).expect("encodes");
        let n = cut.index(bytes.len());
        prop_assert!(decode_value(&bytes[..n]).is_err());
    }
}
