//! The binary wire forms of the `sql-value` cases WIT 0.2.0 added — numeric, timestamp with
//! time zone, date, uuid and one-dimensional arrays — both ways, written out here so that a
//! numeric keeps every digit (no float, no 28-digit decimal on the way) and each value binds with
//! its own type OID. Every input is a plugin's or the server's bytes: lengths are checked
//! before anything is read or allocated by them.

use super::{ResultBudget, SqlArray, SqlValue};

/// Microseconds from 1970-01-01 to PostgreSQL's epoch, 2000-01-01 (UTC).
const PG_EPOCH_MICROS: i64 = 946_684_800_000_000;
/// Days from 1970-01-01 to 2000-01-01.
const PG_EPOCH_DAYS: i32 = 10_957;
/// Digits before the decimal point and after it that a PostgreSQL numeric holds.
const NUMERIC_MAX_INTEGER_DIGITS: i64 = 131_072;
const NUMERIC_MAX_SCALE: i64 = 16_383;
/// Elements of one array in a result. Each takes the host up to ~40 bytes (a text element's
/// `Option<String>` and its allocation) for its 5 bytes on the wire: a 16 MiB message of empty
/// texts would have been 3.4 million of them, 130 MiB of host memory before the result's byte
/// bound saw them.
pub(crate) const MAX_ARRAY_ELEMENTS: usize = 100_000;
const NUMERIC_POS: u16 = 0x0000;
const NUMERIC_NEG: u16 = 0x4000;
const NUMERIC_NAN: u16 = 0xC000;
const NUMERIC_PINF: u16 = 0xD000;
const NUMERIC_NINF: u16 = 0xF000;

/// Type OIDs (pg_type.dat).
mod oid {
    pub(super) const BOOL: u32 = 16;
    pub(super) const INT8: u32 = 20;
    pub(super) const TEXT: u32 = 25;
    pub(super) const FLOAT8: u32 = 701;
    pub(super) const DATE: u32 = 1082;
    pub(super) const TIMESTAMPTZ: u32 = 1184;
    pub(super) const NUMERIC: u32 = 1700;
    pub(super) const UUID: u32 = 2950;
    pub(super) const BOOL_ARRAY: u32 = 1000;
    pub(super) const TEXT_ARRAY: u32 = 1009;
    pub(super) const INT8_ARRAY: u32 = 1016;
    pub(super) const FLOAT8_ARRAY: u32 = 1022;
    pub(super) const DATE_ARRAY: u32 = 1182;
    pub(super) const TIMESTAMPTZ_ARRAY: u32 = 1185;
    pub(super) const NUMERIC_ARRAY: u32 = 1231;
    pub(super) const UUID_ARRAY: u32 = 2951;
}

/// A parameter's type OID and binary value.
pub(super) struct Encoded {
    pub(super) oid: u32,
    pub(super) bytes: Vec<u8>,
}

/// The binary form of a value of a case added in 0.2.0 (`None` for the others, which sqlx
/// encodes itself).
pub(super) fn encode(value: &SqlValue) -> Option<Result<Encoded, String>> {
    let (oid, bytes) = match value {
        SqlValue::Numeric(text) => (oid::NUMERIC, numeric_bytes(text)),
        SqlValue::Timestamp(micros) => (oid::TIMESTAMPTZ, timestamp_bytes(*micros)),
        SqlValue::Date(days) => (oid::DATE, date_bytes(*days)),
        SqlValue::Uuid(text) => (oid::UUID, uuid_bytes(text).map(Vec::from)),
        SqlValue::Array(array) => (array_oid(array), array_bytes(array)),
        _ => return None,
    };
    Some(bytes.map(|bytes| Encoded { oid, bytes }))
}

/// A finite instant that would land on PostgreSQL's `-infinity` (the smallest i64 after the
/// shift to its epoch) is out of range, not `-infinity`.
fn timestamp_bytes(micros: i64) -> Result<Vec<u8>, String> {
    let pg = match micros {
        i64::MAX | i64::MIN => micros,
        m => m
            .checked_sub(PG_EPOCH_MICROS)
            .filter(|pg| *pg != i64::MIN)
            .ok_or("timestamp out of range")?,
    };
    Ok(pg.to_be_bytes().to_vec())
}

/// As [`timestamp_bytes`], for days.
fn date_bytes(days: i32) -> Result<Vec<u8>, String> {
    let pg = match days {
        i32::MAX | i32::MIN => days,
        d => d
            .checked_sub(PG_EPOCH_DAYS)
            .filter(|pg| *pg != i32::MIN)
            .ok_or("date out of range")?,
    };
    Ok(pg.to_be_bytes().to_vec())
}

/// A uuid as PostgreSQL reads one (`uuid_in`): 32 hex digits, optionally in braces, with at
/// most one hyphen after each group of four digits (none after the last).
fn uuid_bytes(text: &str) -> Result<[u8; 16], String> {
    let bad = || format!("invalid uuid {:?}", crate::text::reason(text));
    let inner = match text.strip_prefix('{') {
        Some(t) => t.strip_suffix('}').ok_or_else(bad)?,
        None => text,
    };
    let mut src = inner.as_bytes();
    let mut out = [0u8; 16];
    for (i, byte) in out.iter_mut().enumerate() {
        let [hi, lo, rest @ ..] = src else {
            return Err(bad());
        };
        let digit = |c: &u8| (*c as char).to_digit(16).ok_or_else(bad);
        *byte = ((digit(hi)? << 4) | digit(lo)?) as u8;
        src = rest;
        if i % 2 == 1 && i < 15 && src.first() == Some(&b'-') {
            src = &src[1..];
        }
    }
    if !src.is_empty() {
        return Err(bad());
    }
    Ok(out)
}

/// A decimal text (`-12.50`, `1.5e3`, `NaN`, `Infinity`) in PostgreSQL's binary numeric form:
/// base-10000 digits, the weight of the first, the sign and the display scale. What PostgreSQL
/// could not hold is refused here, before any digit is padded out.
fn numeric_bytes(text: &str) -> Result<Vec<u8>, String> {
    let bad = || format!("invalid numeric {:?}", crate::text::reason(text));
    // PostgreSQL skips ASCII white space around a numeric, nothing else.
    let t = text.trim_matches([' ', '\t', '\n', '\r', '\x0b', '\x0c']);
    let special = match t.to_ascii_lowercase().as_str() {
        "nan" => Some(NUMERIC_NAN),
        "infinity" | "+infinity" | "inf" | "+inf" => Some(NUMERIC_PINF),
        "-infinity" | "-inf" => Some(NUMERIC_NINF),
        _ => None,
    };
    if let Some(sign) = special {
        return Ok(numeric_header(0, 0, sign, 0));
    }
    let (negative, rest) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    let (mantissa, exponent) = match rest.find(['e', 'E']) {
        Some(at) => {
            let e = &rest[at + 1..];
            // Past the range any numeric has, the exponent is refused as written (a longer
            // one would only overflow).
            if e.len() > 8 {
                return Err(format!(
                    "numeric {:?} out of range",
                    crate::text::reason(text)
                ));
            }
            (&rest[..at], e.parse::<i64>().map_err(|_| bad())?)
        }
        None => (rest, 0),
    };
    let (int_part, frac_part) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let all_digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if (int_part.is_empty() && frac_part.is_empty())
        || !all_digits(int_part)
        || !all_digits(frac_part)
    {
        return Err(bad());
    }
    let scale = (frac_part.len() as i64 - exponent).max(0);
    if scale > NUMERIC_MAX_SCALE {
        return Err(format!(
            "numeric {:?} has more than {NUMERIC_MAX_SCALE} digits after the point",
            crate::text::reason(text)
        ));
    }
    // The value is `digits` × 10^`low`: `low` is the position of its last digit.
    let digits: Vec<u8> = int_part
        .bytes()
        .chain(frac_part.bytes())
        .map(|b| b - b'0')
        .skip_while(|d| *d == 0)
        .collect();
    let low = exponent - frac_part.len() as i64;
    if digits.is_empty() {
        return Ok(numeric_header(0, 0, NUMERIC_POS, scale as u16));
    }
    let top = low + digits.len() as i64; // digits before the point
    if top > NUMERIC_MAX_INTEGER_DIGITS {
        return Err(format!(
            "numeric {:?} has more than {NUMERIC_MAX_INTEGER_DIGITS} digits before the point",
            crate::text::reason(text)
        ));
    }
    // Base-10000 groups are aligned on the decimal point: pad the last digit's position down to
    // a multiple of 4 and the first's up.
    let pad_low = low.rem_euclid(4);
    let base = low - pad_low;
    let len = (top - base) as usize;
    let groups = len.div_ceil(4);
    let pad_high = groups * 4 - len;
    let mut padded = vec![0u8; pad_high];
    padded.extend_from_slice(&digits);
    padded.extend(std::iter::repeat_n(0u8, pad_low as usize));
    let mut words: Vec<i16> = padded
        .chunks(4)
        .map(|c| c.iter().fold(0i16, |n, d| n * 10 + *d as i16))
        .collect();
    while words.last() == Some(&0) {
        words.pop();
    }
    let weight = (base + (groups as i64) * 4) / 4 - 1;
    let sign = if negative { NUMERIC_NEG } else { NUMERIC_POS };
    let mut out = numeric_header(words.len() as u16, weight as i16, sign, scale as u16);
    for w in words {
        out.extend_from_slice(&w.to_be_bytes());
    }
    Ok(out)
}

fn numeric_header(ndigits: u16, weight: i16, sign: u16, scale: u16) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + 2 * ndigits as usize);
    out.extend_from_slice(&ndigits.to_be_bytes());
    out.extend_from_slice(&weight.to_be_bytes());
    out.extend_from_slice(&sign.to_be_bytes());
    out.extend_from_slice(&scale.to_be_bytes());
    out
}

/// How long [`numeric_text`] of `raw` can be, from its header alone: what the host charges
/// before printing it.
pub(super) fn numeric_text_len(raw: &[u8]) -> Result<usize, String> {
    let mut r = Reader(raw);
    let _ndigits = r.u16()?;
    let weight = r.u16()? as i16 as i64;
    let _sign = r.u16()?;
    let scale = r.u16()? as i64;
    // A sign; 4 characters per base-10000 digit before the point (at least one); a point and
    // `scale` digits; or "-Infinity", the longest special.
    let int_part = 4 * (weight.max(0) + 1);
    let fraction = if scale > 0 { scale + 1 } else { 0 };
    Ok((1 + int_part + fraction).max(9) as usize)
}

/// A binary numeric as PostgreSQL prints it (`12.50`, `-0.001`, `NaN`).
pub(super) fn numeric_text(raw: &[u8]) -> Result<String, String> {
    let mut r = Reader(raw);
    let ndigits = r.u16()? as usize;
    let weight = r.u16()? as i16 as i64;
    let sign = r.u16()?;
    let scale = r.u16()? as i64;
    match sign {
        NUMERIC_NAN => return Ok("NaN".into()),
        NUMERIC_PINF => return Ok("Infinity".into()),
        NUMERIC_NINF => return Ok("-Infinity".into()),
        NUMERIC_POS | NUMERIC_NEG => {}
        _ => return Err("invalid numeric sign".into()),
    }
    let words = (0..ndigits)
        .map(|_| r.u16())
        .collect::<Result<Vec<u16>, _>>()?;
    if words.iter().any(|w| *w > 9999) || scale > NUMERIC_MAX_SCALE {
        return Err("invalid numeric digits".into());
    }
    let word = |i: i64| -> u16 {
        // Word i has weight `weight - i`.
        usize::try_from(i)
            .ok()
            .and_then(|i| words.get(i))
            .copied()
            .unwrap_or(0)
    };
    let mut out = String::new();
    if sign == NUMERIC_NEG && !words.is_empty() {
        out.push('-');
    }
    if weight < 0 {
        out.push('0');
    } else {
        for i in 0..=weight {
            let w = word(i);
            if i == 0 {
                out.push_str(&w.to_string());
            } else {
                out.push_str(&format!("{w:04}"));
            }
        }
    }
    if scale > 0 {
        out.push('.');
        let mut fraction = String::with_capacity(scale as usize + 4);
        let mut i = weight + 1;
        while (fraction.len() as i64) < scale {
            fraction.push_str(&format!("{:04}", word(i)));
            i += 1;
        }
        fraction.truncate(scale as usize);
        out.push_str(&fraction);
    }
    Ok(out)
}

/// A binary uuid as lower-case hyphenated text.
pub(super) fn uuid_text(raw: &[u8]) -> Result<String, String> {
    if raw.len() != 16 {
        return Err("invalid uuid length".into());
    }
    let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    ))
}

/// A binary timestamp (with or without time zone) in microseconds since 1970 (UTC).
pub(super) fn timestamp_micros(raw: &[u8]) -> Result<i64, String> {
    let pg = Reader(raw).i64()?;
    Ok(match pg {
        i64::MAX | i64::MIN => pg,
        p => p
            .checked_add(PG_EPOCH_MICROS)
            .ok_or("timestamp out of range")?,
    })
}

/// A binary date in days since 1970.
pub(super) fn date_days(raw: &[u8]) -> Result<i32, String> {
    let pg = Reader(raw).i32()?;
    Ok(match pg {
        i32::MAX | i32::MIN => pg,
        p => p.checked_add(PG_EPOCH_DAYS).ok_or("date out of range")?,
    })
}

/// The element kinds of the arrays a result may hold, by the array type's name as sqlx
/// reports it (`INT4[]`); each element decodes by the element type in the array's header.
pub(super) fn is_array_type(type_name: &str) -> bool {
    element_of(type_name).is_some()
}

fn element_of(type_name: &str) -> Option<&str> {
    let element = type_name.strip_suffix("[]")?;
    ELEMENTS.contains(&element).then_some(element)
}

const ELEMENTS: &[&str] = &[
    "BOOL",
    "INT2",
    "INT4",
    "INT8",
    "OID",
    "FLOAT4",
    "FLOAT8",
    "TEXT",
    "VARCHAR",
    "BPCHAR",
    "NAME",
    "CHAR",
    "CITEXT",
    "NUMERIC",
    "TIMESTAMPTZ",
    "TIMESTAMP",
    "DATE",
    "UUID",
];

/// A binary one-dimensional array (an empty one has no dimension). More dimensions are
/// refused; the lower bound is not kept.
pub(super) fn array_value(
    raw: &[u8],
    type_name: &str,
    column: &str,
    budget: &mut ResultBudget,
) -> Result<SqlArray, String> {
    let Some(element) = element_of(type_name) else {
        return Err(format!(
            "column `{column}`: unsupported array type {type_name}"
        ));
    };
    let mut r = Reader(raw);
    let dims = r.i32()?;
    let _has_nulls = r.i32()?;
    let _element_oid = r.u32()?;
    let len = match dims {
        0 => 0usize,
        1 => {
            let len = r.i32()?;
            let _lower = r.i32()?;
            // Each element takes at least its 4-byte length: a count the bytes cannot hold is
            // refused before anything is reserved for it.
            let len = usize::try_from(len)
                .ok()
                .filter(|n| n.saturating_mul(4) <= r.0.len())
                .ok_or("invalid array length")?;
            if len > MAX_ARRAY_ELEMENTS {
                return Err(format!(
                    "column `{column}` is an array of {len} elements; at most \
                     {MAX_ARRAY_ELEMENTS} reach a plugin (unnest it, or aggregate in the query)"
                ));
            }
            len
        }
        _ => {
            return Err(format!(
                "column `{column}` is a {dims}-dimensional array, which has no sql-value; \
                 unnest it or cast it in the query (e.g. `{column}::text`)"
            ));
        }
    };
    // Each element is charged before it is read: its slot in the array, and a text-like
    // element's text (a numeric's as its header says it prints).
    let (slot, texts) = match element {
        "BOOL" => (2, false),
        "DATE" => (8, false),
        "INT2" | "INT4" | "INT8" | "OID" | "FLOAT4" | "FLOAT8" | "TIMESTAMPTZ" | "TIMESTAMP" => {
            (16, false)
        }
        _ => (std::mem::size_of::<Option<String>>(), true),
    };
    let mut items: Vec<Option<&[u8]>> = Vec::with_capacity(len);
    for _ in 0..len {
        let n = r.i32()?;
        let item = if n < 0 {
            None
        } else {
            Some(r.take(n as usize)?)
        };
        match item {
            Some(b) if texts => {
                let len = match element {
                    "NUMERIC" => numeric_text_len(b)?,
                    "UUID" => 36,
                    _ => b.len(),
                };
                budget.charge_text(len, slot)?;
                budget.charge(4, 0)?;
            }
            _ => budget.charge(8, slot)?,
        }
        items.push(item);
    }
    fn each<T>(
        items: &[Option<&[u8]>],
        f: impl Fn(&[u8]) -> Result<T, String>,
    ) -> Result<Vec<Option<T>>, String> {
        items.iter().map(|i| i.map(&f).transpose()).collect()
    }
    let text = |b: &[u8]| String::from_utf8(b.to_vec()).map_err(|e| e.to_string());
    Ok(match element {
        "BOOL" => SqlArray::Boolean(each(&items, |b| Ok(Reader(b).u8()? != 0))?),
        "INT2" => SqlArray::Int(each(&items, |b| Ok(Reader(b).u16()? as i16 as i64))?),
        "INT4" => SqlArray::Int(each(&items, |b| Ok(Reader(b).i32()? as i64))?),
        "OID" => SqlArray::Int(each(&items, |b| Ok(Reader(b).u32()? as i64))?),
        "INT8" => SqlArray::Int(each(&items, |b| Reader(b).i64())?),
        "FLOAT4" => SqlArray::Float(each(&items, |b| {
            Ok(f32::from_bits(Reader(b).u32()?) as f64)
        })?),
        "FLOAT8" => SqlArray::Float(each(&items, |b| {
            Ok(f64::from_bits(Reader(b).i64()? as u64))
        })?),
        "NUMERIC" => SqlArray::Numeric(each(&items, numeric_text)?),
        "TIMESTAMPTZ" | "TIMESTAMP" => SqlArray::Timestamp(each(&items, timestamp_micros)?),
        "DATE" => SqlArray::Date(each(&items, date_days)?),
        "UUID" => SqlArray::Uuid(each(&items, uuid_text)?),
        // The text types (and "char", one byte of text).
        _ => SqlArray::Text(each(&items, text)?),
    })
}

fn array_oid(array: &SqlArray) -> u32 {
    match array {
        SqlArray::Boolean(_) => oid::BOOL_ARRAY,
        SqlArray::Int(_) => oid::INT8_ARRAY,
        SqlArray::Float(_) => oid::FLOAT8_ARRAY,
        SqlArray::Text(_) => oid::TEXT_ARRAY,
        SqlArray::Numeric(_) => oid::NUMERIC_ARRAY,
        SqlArray::Timestamp(_) => oid::TIMESTAMPTZ_ARRAY,
        SqlArray::Date(_) => oid::DATE_ARRAY,
        SqlArray::Uuid(_) => oid::UUID_ARRAY,
    }
}

/// The binary form of a one-dimensional array with lower bound 1 (no dimension when empty),
/// each element written straight into the one buffer (no value of its own per element: an
/// array of 100,000 ints took 100,000 allocations). Past [`MAX_ARRAY_ELEMENTS`] it is refused,
/// as a result's array is.
fn array_bytes(array: &SqlArray) -> Result<Vec<u8>, String> {
    fn write<T>(
        out: &mut Vec<u8>,
        v: &[Option<T>],
        mut f: impl FnMut(&mut Vec<u8>, &T) -> Result<(), String>,
    ) -> Result<(), String> {
        for item in v {
            let Some(item) = item else {
                out.extend_from_slice(&(-1i32).to_be_bytes());
                continue;
            };
            let at = out.len();
            out.extend_from_slice(&[0; 4]);
            f(out, item)?;
            let n = i32::try_from(out.len() - at - 4).map_err(|_| "array element too long")?;
            out[at..at + 4].copy_from_slice(&n.to_be_bytes());
        }
        Ok(())
    }
    let (element, len, nulls) = match array {
        SqlArray::Boolean(v) => (oid::BOOL, v.len(), v.iter().any(Option::is_none)),
        SqlArray::Int(v) => (oid::INT8, v.len(), v.iter().any(Option::is_none)),
        SqlArray::Float(v) => (oid::FLOAT8, v.len(), v.iter().any(Option::is_none)),
        SqlArray::Text(v) => (oid::TEXT, v.len(), v.iter().any(Option::is_none)),
        SqlArray::Numeric(v) => (oid::NUMERIC, v.len(), v.iter().any(Option::is_none)),
        SqlArray::Timestamp(v) => (oid::TIMESTAMPTZ, v.len(), v.iter().any(Option::is_none)),
        SqlArray::Date(v) => (oid::DATE, v.len(), v.iter().any(Option::is_none)),
        SqlArray::Uuid(v) => (oid::UUID, v.len(), v.iter().any(Option::is_none)),
    };
    if len > MAX_ARRAY_ELEMENTS {
        return Err(format!(
            "an array of {len} elements; at most {MAX_ARRAY_ELEMENTS}"
        ));
    }
    let mut out = Vec::with_capacity(20 + len * 12);
    out.extend_from_slice(&(if len == 0 { 0i32 } else { 1 }).to_be_bytes());
    out.extend_from_slice(&(nulls as i32).to_be_bytes());
    out.extend_from_slice(&element.to_be_bytes());
    if len > 0 {
        out.extend_from_slice(&(len as i32).to_be_bytes());
        out.extend_from_slice(&1i32.to_be_bytes());
    }
    let o = &mut out;
    match array {
        SqlArray::Boolean(v) => write(o, v, |o, b| {
            o.push(*b as u8);
            Ok(())
        })?,
        SqlArray::Int(v) => write(o, v, |o, i| {
            o.extend_from_slice(&i.to_be_bytes());
            Ok(())
        })?,
        SqlArray::Float(v) => write(o, v, |o, f| {
            o.extend_from_slice(&f.to_be_bytes());
            Ok(())
        })?,
        SqlArray::Text(v) => write(o, v, |o, s| {
            o.extend_from_slice(s.as_bytes());
            Ok(())
        })?,
        SqlArray::Numeric(v) => write(o, v, |o, s| {
            o.extend(numeric_bytes(s)?);
            Ok(())
        })?,
        SqlArray::Timestamp(v) => write(o, v, |o, t| {
            o.extend(timestamp_bytes(*t)?);
            Ok(())
        })?,
        SqlArray::Date(v) => write(o, v, |o, d| {
            o.extend(date_bytes(*d)?);
            Ok(())
        })?,
        SqlArray::Uuid(v) => write(o, v, |o, s| {
            o.extend(uuid_bytes(s)?);
            Ok(())
        })?,
    }
    Ok(out)
}

/// Reads big-endian fields off a value's bytes; running short is an error, never a panic.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("value shorter than its type".into());
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_be_bytes(self.array()?))
    }
    fn i32(&mut self) -> Result<i32, String> {
        Ok(i32::from_be_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_be_bytes(self.array()?))
    }
    fn i64(&mut self) -> Result<i64, String> {
        Ok(i64::from_be_bytes(self.array()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(text: &str) -> String {
        numeric_text(&numeric_bytes(text).unwrap()).unwrap()
    }

    #[test]
    fn numerics_keep_every_digit_and_their_scale() {
        for (input, printed) in [
            ("0", "0"),
            ("0.00", "0.00"),
            ("12.50", "12.50"),
            ("-12.50", "-12.50"),
            ("+7", "7"),
            ("10000", "10000"),
            ("9999.9999", "9999.9999"),
            ("0.0001", "0.0001"),
            ("0.00001", "0.00001"),
            ("1e-3", "0.001"),
            ("1.5e3", "1500"),
            ("1.25E+2", "125"),
            (
                "123456789012345678901234567890.123456789",
                "123456789012345678901234567890.123456789",
            ),
            (".5", "0.5"),
            ("5.", "5"),
            ("-0.0", "0.0"),
            ("NaN", "NaN"),
            ("-infinity", "-Infinity"),
            ("Infinity", "Infinity"),
        ] {
            assert_eq!(round_trip(input), printed, "{input}");
        }
    }

    #[test]
    fn numerics_past_what_postgres_holds_are_refused_before_padding() {
        for bad in [
            "",
            "-",
            ".",
            "1.2.3",
            "1e",
            "e5",
            "abc",
            "1 2",
            "0x10",
            "1e999999999",
        ] {
            assert!(numeric_bytes(bad).is_err(), "{bad:?}");
        }
        assert!(numeric_bytes("1e131072").is_err());
        assert!(numeric_bytes("1e131071").is_ok());
        assert!(numeric_bytes("1e-16384").is_err());
        assert!(numeric_bytes("1e-16383").is_ok());
    }

    #[test]
    fn uuids_read_like_postgres_and_print_hyphenated() {
        let want = "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11";
        for input in [
            want,
            "A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11",
            "{a0eebc99-9c0b4ef8-bb6d6bb9-bd380a11}",
            "a0eebc999c0b4ef8bb6d6bb9bd380a11",
        ] {
            assert_eq!(uuid_text(&uuid_bytes(input).unwrap()).unwrap(), want);
        }
        for bad in [
            "",
            "a0eebc99",
            "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a111",
            "g0eebc999c0b4ef8bb6d6bb9bd380a11",
        ] {
            assert!(uuid_bytes(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn times_count_from_1970_and_keep_infinity() {
        for micros in [
            0,
            1,
            -1,
            PG_EPOCH_MICROS,
            i64::MAX,
            i64::MIN,
            1_733_000_000_123_456,
        ] {
            assert_eq!(
                timestamp_micros(&timestamp_bytes(micros).unwrap()).unwrap(),
                micros
            );
        }
        assert_eq!(
            timestamp_bytes(PG_EPOCH_MICROS).unwrap(),
            0i64.to_be_bytes()
        );
        for days in [0, -1, PG_EPOCH_DAYS, i32::MAX, i32::MIN, 20_000] {
            assert_eq!(date_days(&date_bytes(days).unwrap()).unwrap(), days);
        }
        assert!(timestamp_bytes(i64::MIN + 1).is_err());
    }

    #[test]
    fn arrays_round_trip_with_nulls_and_refuse_short_or_lying_lengths() {
        let array = SqlArray::Numeric(vec![Some("1.5".into()), None, Some("-2".into())]);
        let bytes = array_bytes(&array).unwrap();
        assert_eq!(
            array_value(&bytes, "NUMERIC[]", "c", &mut ResultBudget::default()).unwrap(),
            array
        );
        let empty = array_bytes(&SqlArray::Int(vec![])).unwrap();
        assert_eq!(
            array_value(&empty, "INT8[]", "c", &mut ResultBudget::default()).unwrap(),
            SqlArray::Int(vec![])
        );
        // A header claiming 2^31-1 elements with no bytes behind them.
        let mut lying = bytes[..12].to_vec();
        lying.extend_from_slice(&i32::MAX.to_be_bytes());
        lying.extend_from_slice(&1i32.to_be_bytes());
        assert!(array_value(&lying, "NUMERIC[]", "c", &mut ResultBudget::default()).is_err());
        for cut in 0..bytes.len() {
            assert!(
                array_value(
                    &bytes[..cut],
                    "NUMERIC[]",
                    "c",
                    &mut ResultBudget::default()
                )
                .is_err(),
                "{cut}"
            );
        }
        let most = SqlArray::Text(vec![Some(String::new()); MAX_ARRAY_ELEMENTS]);
        let mut bytes = array_bytes(&most).unwrap();
        let read = array_value(&bytes, "TEXT[]", "c", &mut ResultBudget::default());
        assert!(read.is_ok());
        // One more element (as the server could send it; a parameter that long is refused).
        bytes[12..16].copy_from_slice(&(MAX_ARRAY_ELEMENTS as i32 + 1).to_be_bytes());
        bytes.extend_from_slice(&0i32.to_be_bytes());
        let refused = array_value(&bytes, "TEXT[]", "c", &mut ResultBudget::default());
        assert!(refused.unwrap_err().contains("100000 reach a plugin"));
        let more = SqlArray::Int(vec![Some(1); MAX_ARRAY_ELEMENTS + 1]);
        assert!(array_bytes(&more).is_err());
    }

    /// What a numeric prints as is charged from its header before it is printed: 1e131071
    /// (14 bytes on the wire, 131,073 characters) in an array of 1,000 is refused at the
    /// result's bounds before any of its texts is built.
    #[test]
    fn a_numeric_is_charged_its_printed_length_before_it_is_printed() {
        for text in [
            "0",
            "-12.50",
            "1e131071",
            "1e-16383",
            "NaN",
            "-Infinity",
            "9999.0001",
        ] {
            let raw = numeric_bytes(text).unwrap();
            let printed = numeric_text(&raw).unwrap();
            let len = numeric_text_len(&raw).unwrap();
            assert!(
                len >= printed.len() && len <= printed.len() + 9,
                "{text}: {len}"
            );
        }
        let huge = SqlArray::Numeric(vec![Some("1e131071".into()); 1_000]);
        let bytes = array_bytes(&huge).unwrap();
        assert!(bytes.len() < 100_000);
        let refused = array_value(&bytes, "NUMERIC[]", "c", &mut ResultBudget::default());
        assert!(refused.unwrap_err().contains("query result exceeds"));
    }

    #[test]
    fn uuids_and_numerics_read_only_what_postgres_reads() {
        for bad in [
            "a-0-e-e-b-c-9-9-9c0b4ef8bb6d6bb9bd380a11",
            "{--a0eebc999c0b4ef8bb6d6bb9bd380a11--}",
            "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11-",
            "-a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
            "a0eeb-c99-9c0b-4ef8-bb6d-6bb9bd380a11",
            "{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
            "a0eebc99--9c0b-4ef8-bb6d-6bb9bd380a11",
        ] {
            assert!(uuid_bytes(bad).is_err(), "{bad}");
        }
        assert!(uuid_bytes("a0ee-bc99-9c0b-4ef8-bb6d-6bb9-bd38-0a11").is_ok());
        assert!(numeric_bytes("\u{3000} 1.5\u{a0}").is_err());
        assert_eq!(
            numeric_text(&numeric_bytes(" \t1.5\n").unwrap()).unwrap(),
            "1.5"
        );
        // A finite time that would land on PostgreSQL's -infinity.
        assert!(timestamp_bytes(i64::MIN + PG_EPOCH_MICROS).is_err());
        assert!(date_bytes(i32::MIN + PG_EPOCH_DAYS).is_err());
    }
}
