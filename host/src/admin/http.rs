//! The client side of the admin endpoint (`idemhost health`, `idemhost plugin`, the tests), on
//! reqwest: one request, the whole exchange within a timeout, errors that say what failed.

use std::time::Duration;

/// A response as the client sees it.
#[derive(Debug)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// The status's reason phrase (`OK`, `Not Found`).
    pub reason: String,
    /// The body, as text.
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
    if !url.starts_with("http://") {
        return Err(format!("{url}: only http:// URLs are supported"));
    }
    let method = reqwest::Method::from_bytes(method.as_bytes())
        .map_err(|_| format!("{method:?} is not an HTTP method"))?;
    let client = reqwest::Client::builder()
        .timeout(timeout)
        .no_proxy()
        .build()
        .map_err(|e| format!("{url}: {e}"))?;
    let mut request = client.request(method, url).body(body.to_vec());
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let describe = |e: reqwest::Error| {
        if e.is_timeout() {
            format!("{url}: no answer within {timeout:?}")
        } else if e.is_connect() {
            format!("cannot connect to {url}: {}", error_chain(&e))
        } else {
            format!("{url}: {}", error_chain(&e))
        }
    };
    let response = request.send().await.map_err(describe)?;
    let status = response.status();
    let body = response.text().await.map_err(describe)?;
    Ok(Response {
        status: status.as_u16(),
        reason: status.canonical_reason().unwrap_or("").to_string(),
        body,
    })
}

/// An error and its causes, `: `-separated (reqwest's own message alone says little).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
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
