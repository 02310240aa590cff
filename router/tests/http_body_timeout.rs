//! The body read timeout through the real HTTP server (`server::Server` over a loopback socket,
//! the app as `quiver-router` serves it, the fake shard behind): a client that sends its headers
//! and half its body gets 408 in OpenAI's shape once `--body-read-timeout-secs` has passed, and
//! its connection is closed, which frees its slot for the next client.

mod http_common;

use std::time::Duration;

use http_common::{completion_body, TestApp};
use quiver_router::http;
use quiver_router::server::{BodyLimits, ConnectionLimits, IdleLimits, Server};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

const BODY_TIMEOUT: Duration = Duration::from_secs(1);
/// Only so that a server that never closes fails the test instead of hanging it.
const GIVE_UP: Duration = Duration::from_secs(60);

/// Serves `app` on a loopback port with one connection slot and a 1 s body timeout.
async fn serve(app: &TestApp) -> (Server, u16) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let limits = ConnectionLimits {
        idle: IdleLimits {
            header_read: Duration::from_secs(30),
            keep_alive: Duration::from_secs(30),
        },
        body: BodyLimits {
            read_timeout: BODY_TIMEOUT,
            min_rate: 0,
        },
        max_connections: 1,
    };
    let routes = http::limit_bodies(http::router(app.state.clone()), 1 << 20);
    (Server::spawn(listener, routes, limits), port)
}

/// Everything the server sends until it closes the connection.
async fn read_until_closed(stream: &mut TcpStream) -> String {
    let mut answer = Vec::new();
    tokio::time::timeout(GIVE_UP, stream.read_to_end(&mut answer))
        .await
        .expect("the server closes the connection")
        .expect("the connection reads cleanly");
    String::from_utf8(answer).expect("UTF-8 answer")
}

#[tokio::test]
async fn half_a_body_gets_408_and_its_connection_closes_after_the_timeout() {
    let app = TestApp::start().await;
    let (_server, port) = serve(&app).await;
    let body = completion_body(json!("Hi"), json!({"max_tokens": 1})).to_string();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: quiver\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    let mut slow = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    slow.write_all(head.as_bytes()).await.unwrap();
    slow.write_all(&body.as_bytes()[..body.len() / 2])
        .await
        .unwrap();
    let sent = Instant::now();

    // The only slot is the slow client's: this one waits in the backlog until it is freed.
    let mut next = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    next.write_all(b"GET /health HTTP/1.1\r\nHost: quiver\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();

    let answer = read_until_closed(&mut slow).await;
    assert!(sent.elapsed() >= BODY_TIMEOUT, "cut before the timeout");
    let (head, json_body) = answer.split_once("\r\n\r\n").expect("a whole response");
    assert!(head.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        head.to_ascii_lowercase().contains("connection: close"),
        "{head}"
    );
    let error: Value = serde_json::from_str(json_body).expect("an OpenAI error body");
    assert_eq!(error["error"]["code"], "request_timeout", "{error}");
    assert_eq!(error["error"]["type"], "invalid_request_error", "{error}");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--body-read-timeout-secs"),
        "{error}"
    );

    let health = read_until_closed(&mut next).await;
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    app.wait_idle().await;
}
