//! Just enough HTTP/1.1 for the admin endpoint, both sides: one request per connection, a
//! `Content-Length` body (no chunked encoding), bounded sizes and timeouts. The admin endpoint
//! serves operators and orchestrators on a private port, not the internet.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// Longest request or response head (request line or status line plus headers).
pub const MAX_HEAD_BYTES: usize = 16 << 10;
/// How long one read may stall before the peer is given up on.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// A parsed request.
#[derive(Debug)]
pub struct Request {
    pub method: String,
    /// The path without the query string.
    pub path: String,
    /// The query string's `key=value` pairs, decoded.
    pub query: Vec<(String, String)>,
    /// Header names lower-cased.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn query(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Why a request could not be read; each maps to a status.
#[derive(Debug)]
pub enum ReadError {
    /// The peer went away or stalled: no answer.
    Gone,
    /// 400, with why.
    Bad(String),
    /// 411: a body without `Content-Length`.
    LengthRequired,
    /// 413: a body over the limit.
    TooLarge(u64),
}

/// Reads one request; a body only up to `max_body` bytes. Answers `Expect: 100-continue`.
pub async fn read_request(stream: &mut TcpStream, max_body: u64) -> Result<Request, ReadError> {
    let (head, mut body) = read_head(stream).await?;
    let mut lines = head.split("\r\n");
    let mut first = lines.next().unwrap_or("").split_whitespace();
    let (method, target) = match (first.next(), first.next()) {
        (Some(m), Some(t)) => (m.to_string(), t.to_string()),
        _ => return Err(ReadError::Bad("malformed request line".into())),
    };
    let mut headers = Vec::new();
    for line in lines.filter(|l| !l.is_empty()) {
        let (k, v) = line
            .split_once(':')
            .ok_or_else(|| ReadError::Bad(format!("malformed header line {line:?}")))?;
        headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
    }
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (
            p.to_string(),
            url::form_urlencoded::parse(q.as_bytes())
                .into_owned()
                .collect(),
        ),
        None => (target, Vec::new()),
    };
    let mut request = Request {
        method,
        path,
        query,
        headers,
        body: Vec::new(),
    };
    if request.header("transfer-encoding").is_some() {
        return Err(ReadError::LengthRequired);
    }
    let length: u64 = match request.header("content-length") {
        None => 0,
        Some(v) => v
            .parse()
            .map_err(|_| ReadError::Bad(format!("bad Content-Length {v:?}")))?,
    };
    if length > max_body {
        return Err(ReadError::TooLarge(max_body));
    }
    if length > 0
        && request
            .header("expect")
            .is_some_and(|e| e.eq_ignore_ascii_case("100-continue"))
    {
        stream
            .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            .await
            .map_err(|_| ReadError::Gone)?;
    }
    let length = length as usize;
    body.truncate(length);
    body.reserve(length - body.len());
    while body.len() < length {
        let mut chunk = vec![0u8; (length - body.len()).min(1 << 20)];
        let n = read_some(stream, &mut chunk).await?;
        body.extend_from_slice(&chunk[..n]);
    }
    request.body = body;
    Ok(request)
}

/// Reads up to the blank line ending the head; returns the head and what followed it.
async fn read_head(stream: &mut (impl AsyncRead + Unpin)) -> Result<(String, Vec<u8>), ReadError> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = find(&buf, b"\r\n\r\n") {
            let rest = buf.split_off(end + 4);
            buf.truncate(end);
            let head =
                String::from_utf8(buf).map_err(|_| ReadError::Bad("head is not UTF-8".into()))?;
            return Ok((head, rest));
        }
        if buf.len() > MAX_HEAD_BYTES {
            return Err(ReadError::Bad(format!("head over {MAX_HEAD_BYTES} bytes")));
        }
        let n = read_some(stream, &mut chunk).await?;
        buf.extend_from_slice(&chunk[..n]);
    }
}

async fn read_some(
    stream: &mut (impl AsyncRead + Unpin),
    buf: &mut [u8],
) -> Result<usize, ReadError> {
    match tokio::time::timeout(READ_TIMEOUT, stream.read(buf)).await {
        Ok(Ok(n)) if n > 0 => Ok(n),
        _ => Err(ReadError::Gone),
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Writes a whole response and closes the connection.
pub async fn respond(
    stream: &mut (impl AsyncWrite + Unpin),
    status: &str,
    content_type: &str,
    body: &[u8],
) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body).await?;
    stream.shutdown().await
}

/// A response as the client sees it.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    /// The status line after the code (`OK`, `Not Found`).
    pub reason: String,
    pub body: String,
}

/// Sends one request to `url` (`http://host:port/path?query`) and reads the answer, all within
/// `timeout`. Errors say what failed (connect, send, read).
pub async fn request(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> Result<Response, String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("{url}: only http:// URLs are supported"))?;
    let (authority, target) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let exchange = async {
        let mut stream = TcpStream::connect(authority)
            .await
            .map_err(|e| format!("cannot connect to {authority}: {e}"))?;
        let mut head = format!(
            "{method} {target} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\nContent-Length: {}\r\n",
            body.len()
        );
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        let sent = async {
            stream.write_all(head.as_bytes()).await?;
            stream.write_all(body).await
        };
        sent.await
            .map_err(|e| format!("cannot send to {authority}: {e}"))?;
        let mut response = Vec::new();
        stream
            .read_to_end(&mut response)
            .await
            .map_err(|e| format!("cannot read from {authority}: {e}"))?;
        parse_response(&response).ok_or_else(|| format!("{url}: malformed response"))
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| format!("{url}: no answer within {timeout:?}"))?
}

/// [`request`], succeeding only on a 200 (with its body); any other answer is an error that
/// quotes the status and the body.
pub async fn request_ok(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> Result<String, String> {
    let r = request(method, url, headers, body, timeout).await?;
    if r.status == 200 {
        Ok(r.body)
    } else {
        Err(format!(
            "{url}: HTTP/1.1 {} {}: {}",
            r.status,
            r.reason,
            r.body.trim()
        ))
    }
}

/// GETs `url`: the body of a 200, else an error quoting the answer.
pub async fn get(url: &str, timeout: Duration) -> Result<String, String> {
    request_ok("GET", url, &[], &[], timeout).await
}

fn parse_response(raw: &[u8]) -> Option<Response> {
    let end = find(raw, b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&raw[..end]);
    let mut status_line = head.lines().next()?.splitn(3, ' ');
    let _version = status_line.next()?;
    let status = status_line.next()?.parse().ok()?;
    let reason = status_line.next().unwrap_or("").to_string();
    let body = String::from_utf8_lossy(&raw[end + 4..]).into_owned();
    Some(Response {
        status,
        reason,
        body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn head_is_split_from_the_body_start() {
        let mut input: &[u8] =
            b"POST /plugins?consumer=a%2Fb HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc";
        let (head, rest) = read_head(&mut input).await.unwrap();
        assert!(head.starts_with("POST /plugins?consumer=a%2Fb"));
        assert_eq!(rest, b"abc");
    }

    #[test]
    fn responses_parse() {
        let r = parse_response(b"HTTP/1.1 404 Not Found\r\nA: b\r\n\r\nno such thing\n").unwrap();
        assert_eq!(
            (r.status, r.reason.as_str(), r.body.as_str()),
            (404, "Not Found", "no such thing\n")
        );
        assert!(parse_response(b"garbage").is_none());
    }
}
