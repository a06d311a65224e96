// A strict JSON parser (RFC 8259) with serde_json's rules: UTF-8 input only, integers kept
// exact as BigInt within the i64/u64 range, other numbers as Number, duplicate keys refused for
// the names in `strictKeys`, nesting limited to 128 levels.

export class Malformed extends Error {}

const MAX_DEPTH = 128;
const I64_MIN = -(2n ** 63n);
const U64_MAX = 2n ** 64n - 1n;

export function parseJson(bytes, strictKeys = []) {
  let text;
  try {
    text = new TextDecoder('utf-8', { fatal: true }).decode(bytes);
  } catch {
    throw new Malformed('payload is not UTF-8');
  }
  const strict = new Set(strictKeys);
  let i = 0;
  const fail = (what) => {
    throw new Malformed(`${what} at offset ${i}`);
  };
  const ws = () => {
    while (i < text.length && ' \t\n\r'.includes(text[i])) i++;
  };
  const expect = (word) => {
    if (text.startsWith(word, i)) i += word.length;
    else fail('expected value');
  };
  const string = () => {
    i++; // opening quote
    let out = '';
    for (;;) {
      if (i >= text.length) fail('EOF while parsing a string');
      const c = text[i++];
      if (c === '"') return out;
      if (c < ' ') fail('control character in string');
      if (c !== '\\') {
        out += c;
        continue;
      }
      const e = text[i++];
      const simple = { '"': '"', '\\': '\\', '/': '/', b: '\b', f: '\f', n: '\n', r: '\r', t: '\t' };
      if (e in simple) {
        out += simple[e];
      } else if (e === 'u') {
        const hex = text.slice(i, i + 4);
        if (!/^[0-9a-fA-F]{4}$/.test(hex)) fail('invalid escape');
        i += 4;
        let code = parseInt(hex, 16);
        if (code >= 0xd800 && code < 0xdc00) {
          const low = text.slice(i, i + 6);
          if (!/^\\u[dD][c-fC-F][0-9a-fA-F]{2}$/.test(low)) fail('lone leading surrogate');
          i += 6;
          code = 0x10000 + ((code - 0xd800) << 10) + (parseInt(low.slice(2), 16) - 0xdc00);
        } else if (code >= 0xdc00 && code < 0xe000) {
          fail('lone trailing surrogate');
        }
        out += String.fromCodePoint(code);
      } else {
        fail('invalid escape');
      }
    }
  };
  const number = () => {
    const m = /^-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/.exec(text.slice(i));
    if (!m) fail('invalid number');
    i += m[0].length;
    if (m[2] === undefined && m[3] === undefined) {
      const n = BigInt(m[0]);
      if (n >= I64_MIN && n <= U64_MAX) return n;
    }
    const f = Number(m[0]);
    if (!Number.isFinite(f)) fail('number out of range');
    return f;
  };
  const value = (depth) => {
    ws();
    if (i >= text.length) fail('EOF while parsing a value');
    const c = text[i];
    if (c === '{' || c === '[') {
      if (depth >= MAX_DEPTH) fail('recursion limit exceeded');
      i++;
      const close = c === '{' ? '}' : ']';
      const out = c === '{' ? {} : [];
      ws();
      if (text[i] === close) {
        i++;
        return out;
      }
      for (;;) {
        if (c === '{') {
          ws();
          if (text[i] !== '"') fail('key must be a string');
          const key = string();
          ws();
          if (text[i++] !== ':') fail('expected `:`');
          const v = value(depth + 1);
          if (depth === 0 && strict.has(key) && Object.hasOwn(out, key)) {
            throw new Malformed(`duplicate field \`${key}\``);
          }
          Object.defineProperty(out, key, { value: v, enumerable: true, writable: true, configurable: true });
        } else {
          out.push(value(depth + 1));
        }
        ws();
        const sep = text[i++];
        if (sep === close) return out;
        if (sep !== ',') fail(`expected \`,\` or \`${close}\``);
      }
    }
    if (c === '"') return string();
    if (c === 't') return expect('true'), true;
    if (c === 'f') return expect('false'), false;
    if (c === 'n') return expect('null'), null;
    return number();
  };
  const v = value(0);
  ws();
  if (i < text.length) fail('trailing characters');
  return v;
}
