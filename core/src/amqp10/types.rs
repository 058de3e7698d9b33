//! AMQP 1.0's type system (OASIS AMQP 1.0 part 1): every primitive in every width the spec
//! defines, described types, lists, maps and arrays.
//!
//! Decoding takes every width a peer may choose (`0x43` uint0, `0x52` smalluint, `0x70`
//! uint, ...). Encoding picks the narrowest form, as RabbitMQ and Qpid do, so frames stay
//! small; an array's elements share one constructor, so they use the wide form of their
//! type (a `smalluint` element could not hold a large sibling).

use bytes::{BufMut, Bytes, BytesMut};

/// Nesting a decoded value may have: bounds the recursion on peer input.
pub const MAX_DEPTH: usize = 32;

/// Why bytes are not an AMQP 1.0 value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("truncated value")]
    /// The input ends inside a value.
    Truncated,
    #[error("unknown type code 0x{0:02x}")]
    /// A constructor byte the spec does not define.
    UnknownCode(u8),
    #[error("string not UTF-8")]
    /// A `string` or `symbol` that is not UTF-8.
    Utf8,
    #[error("char not a Unicode scalar value")]
    /// A `char` that is not a Unicode scalar value.
    Char,
    #[error("compound count {count} beyond its size {size}")]
    /// A list/map/array claims more items than its bytes can hold.
    Count {
        /// Items claimed.
        count: usize,
        /// Bytes they would fit in.
        size: usize,
    },
    #[error("compound size does not match its items")]
    /// A compound whose items do not fill exactly its size.
    SizeMismatch,
    #[error("map with an odd number of items")]
    /// A map with a key and no value.
    OddMap,
    #[error("nested deeper than {MAX_DEPTH}")]
    /// Nesting beyond [`MAX_DEPTH`].
    TooDeep,
    #[error("field {0}: wrong type")]
    /// A value of the wrong type where the spec fixes one.
    Field(&'static str),
    #[error("field {0}: mandatory but absent")]
    /// A mandatory field left out.
    Missing(&'static str),
    #[error("unexpected descriptor {0}")]
    /// A described type other than the one expected.
    Descriptor(String),
    #[error("not an AMQP 1.0 message: {0}")]
    /// Valid values that do not form a message (sections).
    Message(&'static str),
}

/// Why a value cannot be encoded (a bug in the caller, never peer input).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    #[error("array elements of different types")]
    /// An array whose elements are not all of one type.
    MixedArray,
    #[error("value larger than 4 GiB")]
    /// A value or compound beyond the 4-byte length fields.
    TooLarge,
}

/// A described type's descriptor: a numeric code (domain << 32 | id) or a symbol.
#[derive(Clone, Debug, PartialEq)]
pub enum Descriptor {
    /// `0x00` then a `ulong`.
    Code(u64),
    /// `0x00` then a `symbol` (`amqp:open:list`).
    Symbol(String),
}

/// An AMQP 1.0 value.
#[derive(Clone, Debug, PartialEq, Default)]
pub enum Value {
    #[default]
    /// `0x40`.
    Null,
    /// `0x41` true, `0x42` false, `0x56` and one byte.
    Bool(bool),
    /// `0x50`.
    UByte(u8),
    /// `0x60`.
    UShort(u16),
    /// `0x70`, `0x52` one byte, `0x43` zero.
    UInt(u32),
    /// `0x80`, `0x53` one byte, `0x44` zero.
    ULong(u64),
    /// `0x51`.
    Byte(i8),
    /// `0x61`.
    Short(i16),
    /// `0x71`, `0x54` one byte.
    Int(i32),
    /// `0x81`, `0x55` one byte.
    Long(i64),
    /// `0x72`, IEEE 754 binary32.
    Float(f32),
    /// `0x82`, IEEE 754 binary64.
    Double(f64),
    /// IEEE 754 decimals (`0x74`), kept as their bytes (nothing here computes with them).
    Decimal32([u8; 4]),
    /// `0x84`.
    Decimal64([u8; 8]),
    /// `0x94`.
    Decimal128([u8; 16]),
    /// `0x73`, UTF-32BE.
    Char(char),
    /// `0x83`: milliseconds since the Unix epoch.
    Timestamp(i64),
    /// `0x98`.
    Uuid([u8; 16]),
    /// `0xa0` 1-byte length, `0xb0` 4-byte length.
    Binary(Bytes),
    /// `0xa1` / `0xb1`, UTF-8.
    String(String),
    /// `0xa3` / `0xb3`, ASCII.
    Symbol(String),
    /// `0x45` empty, `0xc0` 1-byte size and count, `0xd0` 4-byte.
    List(Vec<Value>),
    /// `0xc1` / `0xd1`: keys and values alternating; count counts both.
    Map(Vec<(Value, Value)>),
    /// `0xe0` / `0xf0`: size, count, one constructor, then the elements (one type).
    Array(Vec<Value>),
    /// `0x00`, the descriptor, the value.
    Described(Box<Descriptor>, Box<Value>),
}

impl Value {
    /// `v` described by the numeric `code`.
    pub fn described(code: u64, v: Value) -> Value {
        Value::Described(Box::new(Descriptor::Code(code)), Box::new(v))
    }

    /// The numeric descriptor of a described value (a symbolic one the spec names is
    /// mapped to its code).
    pub fn descriptor_code(&self) -> Option<u64> {
        match self {
            Value::Described(d, _) => match d.as_ref() {
                Descriptor::Code(c) => Some(*c),
                Descriptor::Symbol(s) => super::descriptor::code_of(s),
            },
            _ => None,
        }
    }

    /// Whether this is `null` (a field left at its default).
    pub fn is_null(&self) -> bool {
        matches!(self, Value::Null)
    }

    /// A symbol value.
    pub fn symbol(s: &str) -> Value {
        Value::Symbol(s.to_string())
    }

    /// Appends the encoding of `self` to `out`.
    pub fn encode(&self, out: &mut BytesMut) -> Result<(), EncodeError> {
        match self {
            Value::Null => out.put_u8(0x40),
            Value::Bool(true) => out.put_u8(0x41),
            Value::Bool(false) => out.put_u8(0x42),
            Value::UInt(0) => out.put_u8(0x43),
            Value::UInt(v) if *v < 256 => {
                out.put_u8(0x52);
                out.put_u8(*v as u8);
            }
            Value::ULong(0) => out.put_u8(0x44),
            Value::ULong(v) if *v < 256 => {
                out.put_u8(0x53);
                out.put_u8(*v as u8);
            }
            Value::Int(v) if i8::try_from(*v).is_ok() => {
                out.put_u8(0x54);
                out.put_i8(*v as i8);
            }
            Value::Long(v) if i8::try_from(*v).is_ok() => {
                out.put_u8(0x55);
                out.put_i8(*v as i8);
            }
            Value::List(items) if items.is_empty() => out.put_u8(0x45),
            Value::List(items) => {
                let mut inner = BytesMut::new();
                for item in items {
                    item.encode(&mut inner)?;
                }
                compound(out, 0xc0, 0xd0, items.len(), &inner)?;
            }
            Value::Map(entries) => {
                let mut inner = BytesMut::new();
                for (k, v) in entries {
                    k.encode(&mut inner)?;
                    v.encode(&mut inner)?;
                }
                compound(out, 0xc1, 0xd1, entries.len() * 2, &inner)?;
            }
            Value::Array(items) => {
                let mut inner = BytesMut::new();
                if let Some(first) = items.first() {
                    first.constructor(&mut inner)?;
                    for item in items {
                        if !first.same_type(item) {
                            return Err(EncodeError::MixedArray);
                        }
                        item.element(&mut inner)?;
                    }
                } else {
                    // An empty array still needs a constructor; the only empty arrays the
                    // spec's frames carry are symbol arrays (capabilities, mechanisms).
                    inner.put_u8(0xa3);
                }
                compound(out, 0xe0, 0xf0, items.len(), &inner)?;
            }
            Value::Described(d, v) => {
                out.put_u8(0x00);
                d.value().encode(out)?;
                v.encode(out)?;
            }
            Value::Binary(b) => variable(out, 0xa0, 0xb0, b)?,
            Value::String(s) => variable(out, 0xa1, 0xb1, s.as_bytes())?,
            Value::Symbol(s) => variable(out, 0xa3, 0xb3, s.as_bytes())?,
            other => {
                other.constructor(out)?;
                other.element(out)?;
            }
        }
        Ok(())
    }

    /// Whether `other` can share an array constructor with `self`.
    fn same_type(&self, other: &Value) -> bool {
        match (self, other) {
            (Value::Described(a, x), Value::Described(b, y)) => a == b && x.same_type(y),
            _ => std::mem::discriminant(self) == std::mem::discriminant(other),
        }
    }

    /// The wide constructor of this value's type (an array element's).
    fn constructor(&self, out: &mut BytesMut) -> Result<(), EncodeError> {
        let code = match self {
            Value::Null => 0x40,
            Value::Bool(_) => 0x56,
            Value::UByte(_) => 0x50,
            Value::UShort(_) => 0x60,
            Value::UInt(_) => 0x70,
            Value::ULong(_) => 0x80,
            Value::Byte(_) => 0x51,
            Value::Short(_) => 0x61,
            Value::Int(_) => 0x71,
            Value::Long(_) => 0x81,
            Value::Float(_) => 0x72,
            Value::Double(_) => 0x82,
            Value::Decimal32(_) => 0x74,
            Value::Decimal64(_) => 0x84,
            Value::Decimal128(_) => 0x94,
            Value::Char(_) => 0x73,
            Value::Timestamp(_) => 0x83,
            Value::Uuid(_) => 0x98,
            Value::Binary(_) => 0xb0,
            Value::String(_) => 0xb1,
            Value::Symbol(_) => 0xb3,
            Value::List(_) => 0xd0,
            Value::Map(_) => 0xd1,
            Value::Array(_) => 0xf0,
            Value::Described(d, v) => {
                out.put_u8(0x00);
                d.value().encode(out)?;
                return v.constructor(out);
            }
        };
        out.put_u8(code);
        Ok(())
    }

    /// The value's bytes after its wide constructor.
    fn element(&self, out: &mut BytesMut) -> Result<(), EncodeError> {
        match self {
            Value::Null => {}
            Value::Bool(b) => out.put_u8(u8::from(*b)),
            Value::UByte(v) => out.put_u8(*v),
            Value::UShort(v) => out.put_u16(*v),
            Value::UInt(v) => out.put_u32(*v),
            Value::ULong(v) => out.put_u64(*v),
            Value::Byte(v) => out.put_i8(*v),
            Value::Short(v) => out.put_i16(*v),
            Value::Int(v) => out.put_i32(*v),
            Value::Long(v) => out.put_i64(*v),
            Value::Float(v) => out.put_f32(*v),
            Value::Double(v) => out.put_f64(*v),
            Value::Decimal32(b) => out.put_slice(b),
            Value::Decimal64(b) => out.put_slice(b),
            Value::Decimal128(b) => out.put_slice(b),
            Value::Char(c) => out.put_u32(u32::from(*c)),
            Value::Timestamp(v) => out.put_i64(*v),
            Value::Uuid(b) => out.put_slice(b),
            Value::Binary(b) => wide(out, b)?,
            Value::String(s) | Value::Symbol(s) => wide(out, s.as_bytes())?,
            Value::List(_) | Value::Map(_) | Value::Array(_) => {
                // The wide compound form after the constructor: re-encode and drop the
                // (possibly narrow) constructor the compound encoder chose.
                let mut full = BytesMut::new();
                self.encode(&mut full)?;
                match full.first() {
                    Some(0x45) => {
                        out.put_u32(4);
                        out.put_u32(0);
                    }
                    Some(0xc0 | 0xc1 | 0xe0) => {
                        let size = u32::from(full[1]);
                        let count = u32::from(full[2]);
                        out.put_u32(size + 3);
                        out.put_u32(count);
                        out.put_slice(&full[3..]);
                    }
                    _ => out.put_slice(&full[1..]),
                }
            }
            Value::Described(_, v) => v.element(out)?,
        }
        Ok(())
    }

    /// The text of a string or symbol.
    pub fn text(&self) -> Option<&str> {
        match self {
            Value::String(s) | Value::Symbol(s) => Some(s),
            _ => None,
        }
    }
}

impl Descriptor {
    fn value(&self) -> Value {
        match self {
            Descriptor::Code(c) => Value::ULong(*c),
            Descriptor::Symbol(s) => Value::Symbol(s.clone()),
        }
    }
}

fn wide(out: &mut BytesMut, b: &[u8]) -> Result<(), EncodeError> {
    out.put_u32(u32::try_from(b.len()).map_err(|_| EncodeError::TooLarge)?);
    out.put_slice(b);
    Ok(())
}

fn variable(out: &mut BytesMut, short: u8, long: u8, b: &[u8]) -> Result<(), EncodeError> {
    match u8::try_from(b.len()) {
        Ok(n) => {
            out.put_u8(short);
            out.put_u8(n);
            out.put_slice(b);
            Ok(())
        }
        Err(_) => {
            out.put_u8(long);
            wide(out, b)
        }
    }
}

/// A list/map/array: the 1-byte form when size and count fit, else the 4-byte form.
fn compound(
    out: &mut BytesMut,
    short: u8,
    long: u8,
    count: usize,
    items: &[u8],
) -> Result<(), EncodeError> {
    // size counts the count field too.
    match (u8::try_from(items.len() + 1), u8::try_from(count)) {
        (Ok(size), Ok(count)) => {
            out.put_u8(short);
            out.put_u8(size);
            out.put_u8(count);
        }
        _ => {
            out.put_u8(long);
            out.put_u32(u32::try_from(items.len() + 4).map_err(|_| EncodeError::TooLarge)?);
            out.put_u32(u32::try_from(count).map_err(|_| EncodeError::TooLarge)?);
        }
    }
    out.put_slice(items);
    Ok(())
}

/// Reads values from a buffer; `pos` is where the next value starts.
pub struct Reader<'a> {
    data: &'a Bytes,
    /// Offset of the next byte to read.
    pub pos: usize,
}

impl<'a> Reader<'a> {
    /// A reader at the start of `data`.
    pub fn new(data: &'a Bytes) -> Self {
        Reader { data, pos: 0 }
    }

    /// Whether every byte has been read.
    pub fn at_end(&self) -> bool {
        self.pos >= self.data.len()
    }

    fn take(&mut self, n: usize) -> Result<&[u8], DecodeError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.data.len())
            .ok_or(DecodeError::Truncated)?;
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    fn fixed<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn len(&mut self, wide: bool) -> Result<usize, DecodeError> {
        Ok(if wide {
            u32::from_be_bytes(self.fixed()?) as usize
        } else {
            usize::from(self.u8()?)
        })
    }

    fn bytes(&mut self, wide: bool) -> Result<Bytes, DecodeError> {
        let n = self.len(wide)?;
        let start = self.pos;
        self.take(n)?;
        Ok(self.data.slice(start..self.pos))
    }

    fn text(&mut self, wide: bool) -> Result<String, DecodeError> {
        let n = self.len(wide)?;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| DecodeError::Utf8)
    }

    /// A compound's size and count; returns (count, end). The size counts the count field.
    fn header(&mut self, wide: bool) -> Result<(usize, usize), DecodeError> {
        let size = self.len(wide)?;
        let end = self.pos.checked_add(size).ok_or(DecodeError::Truncated)?;
        if end > self.data.len() {
            return Err(DecodeError::Truncated);
        }
        let count = self.len(wide)?;
        // Every item takes at least one byte (an array element of null takes none, but an
        // array of nulls is bounded by MAX_ARRAY_NULLS below): a count beyond the size is a
        // lie that would make us allocate for it.
        if count > size {
            return Err(DecodeError::Count { count, size });
        }
        Ok((count, end))
    }

    fn items(&mut self, wide: bool, depth: usize) -> Result<Vec<Value>, DecodeError> {
        let (count, end) = self.header(wide)?;
        let mut items = Vec::with_capacity(count);
        for _ in 0..count {
            items.push(self.value_at(depth + 1)?);
        }
        if self.pos != end {
            return Err(DecodeError::SizeMismatch);
        }
        Ok(items)
    }

    fn array(&mut self, wide: bool, depth: usize) -> Result<Vec<Value>, DecodeError> {
        let (count, end) = self.header(wide)?;
        let (descriptor, code) = self.constructor(depth)?;
        let mut items = Vec::with_capacity(count);
        for _ in 0..count {
            let v = self.typed(code, depth + 1)?;
            items.push(match &descriptor {
                Some(d) => Value::Described(Box::new(d.clone()), Box::new(v)),
                None => v,
            });
        }
        if self.pos != end {
            return Err(DecodeError::SizeMismatch);
        }
        Ok(items)
    }

    /// An array's element constructor: a type code, perhaps after a descriptor.
    fn constructor(&mut self, depth: usize) -> Result<(Option<Descriptor>, u8), DecodeError> {
        let code = self.u8()?;
        if code != 0x00 {
            return Ok((None, code));
        }
        let d = descriptor(self.value_at(depth + 1)?)?;
        let code = self.u8()?;
        if code == 0x00 {
            // Nested descriptors in an array constructor: legal in theory, never used.
            return Err(DecodeError::UnknownCode(0x00));
        }
        Ok((Some(d), code))
    }

    /// A described value's descriptor, if one starts here (its value comes next).
    pub fn descriptor(&mut self) -> Result<Option<Descriptor>, DecodeError> {
        if self.data.get(self.pos) != Some(&0x00) {
            return Ok(None);
        }
        self.pos += 1;
        descriptor(self.value_at(1)?).map(Some)
    }

    /// The next value.
    pub fn value(&mut self) -> Result<Value, DecodeError> {
        self.value_at(0)
    }

    fn value_at(&mut self, depth: usize) -> Result<Value, DecodeError> {
        let code = self.u8()?;
        self.typed(code, depth)
    }

    fn typed(&mut self, code: u8, depth: usize) -> Result<Value, DecodeError> {
        if depth > MAX_DEPTH {
            return Err(DecodeError::TooDeep);
        }
        Ok(match code {
            0x00 => {
                let d = descriptor(self.value_at(depth + 1)?)?;
                Value::Described(Box::new(d), Box::new(self.value_at(depth + 1)?))
            }
            0x40 => Value::Null,
            0x41 => Value::Bool(true),
            0x42 => Value::Bool(false),
            0x56 => match self.u8()? {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                _ => return Err(DecodeError::Field("boolean")),
            },
            0x50 => Value::UByte(self.u8()?),
            0x60 => Value::UShort(u16::from_be_bytes(self.fixed()?)),
            0x70 => Value::UInt(u32::from_be_bytes(self.fixed()?)),
            0x52 => Value::UInt(u32::from(self.u8()?)),
            0x43 => Value::UInt(0),
            0x80 => Value::ULong(u64::from_be_bytes(self.fixed()?)),
            0x53 => Value::ULong(u64::from(self.u8()?)),
            0x44 => Value::ULong(0),
            0x51 => Value::Byte(i8::from_be_bytes(self.fixed()?)),
            0x61 => Value::Short(i16::from_be_bytes(self.fixed()?)),
            0x71 => Value::Int(i32::from_be_bytes(self.fixed()?)),
            0x54 => Value::Int(i32::from(i8::from_be_bytes(self.fixed()?))),
            0x81 => Value::Long(i64::from_be_bytes(self.fixed()?)),
            0x55 => Value::Long(i64::from(i8::from_be_bytes(self.fixed()?))),
            0x72 => Value::Float(f32::from_be_bytes(self.fixed()?)),
            0x82 => Value::Double(f64::from_be_bytes(self.fixed()?)),
            0x74 => Value::Decimal32(self.fixed()?),
            0x84 => Value::Decimal64(self.fixed()?),
            0x94 => Value::Decimal128(self.fixed()?),
            0x73 => Value::Char(
                char::from_u32(u32::from_be_bytes(self.fixed()?)).ok_or(DecodeError::Char)?,
            ),
            0x83 => Value::Timestamp(i64::from_be_bytes(self.fixed()?)),
            0x98 => Value::Uuid(self.fixed()?),
            0xa0 | 0xb0 => Value::Binary(self.bytes(code == 0xb0)?),
            0xa1 | 0xb1 => Value::String(self.text(code == 0xb1)?),
            0xa3 | 0xb3 => Value::Symbol(self.text(code == 0xb3)?),
            0x45 => Value::List(Vec::new()),
            0xc0 | 0xd0 => Value::List(self.items(code == 0xd0, depth)?),
            0xc1 | 0xd1 => Value::Map(pairs(self.items(code == 0xd1, depth)?)?),
            0xe0 | 0xf0 => Value::Array(self.array(code == 0xf0, depth)?),
            other => return Err(DecodeError::UnknownCode(other)),
        })
    }
}

fn descriptor(v: Value) -> Result<Descriptor, DecodeError> {
    match v {
        Value::ULong(c) => Ok(Descriptor::Code(c)),
        Value::Symbol(s) => Ok(Descriptor::Symbol(s)),
        _ => Err(DecodeError::Field("descriptor")),
    }
}

fn pairs(items: Vec<Value>) -> Result<Vec<(Value, Value)>, DecodeError> {
    if !items.len().is_multiple_of(2) {
        return Err(DecodeError::OddMap);
    }
    let mut it = items.into_iter();
    let mut out = Vec::new();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        out.push((k, v));
    }
    Ok(out)
}

/// The reader under the name the frame layer uses.
pub type Decoder<'a> = Reader<'a>;

/// One value from `data` (copied), which must hold exactly it.
pub fn decode_value(data: &[u8]) -> Result<Value, DecodeError> {
    decode(&Bytes::copy_from_slice(data))
}

/// Appends `v` to `out`.
pub fn encode_value(out: &mut BytesMut, v: &Value) -> Result<(), EncodeError> {
    v.encode(out)
}

/// One value from `data`, which must hold exactly it.
pub fn decode(data: &Bytes) -> Result<Value, DecodeError> {
    let mut r = Reader::new(data);
    let v = r.value()?;
    if !r.at_end() {
        return Err(DecodeError::SizeMismatch);
    }
    Ok(v)
}

/// `v` encoded on its own.
pub fn encode(v: &Value) -> Result<Bytes, EncodeError> {
    let mut out = BytesMut::new();
    v.encode(&mut out)?;
    Ok(out.freeze())
}
