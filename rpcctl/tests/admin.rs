//! `rpcctl status` and `rpcctl events`, the built program run against a real process's admin
//! endpoint (this test process: a server, a client that called it, and the endpoint, over
//! TCP on loopback). Expected values come from what the test did to the client.

#[path = "../../tests/tests/common/child.rs"]
mod child;

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use child::wait_within;

use rpc::admin::{Admin, AdminHandle};
use rpc::{Client, GovernanceOverrides, InProcessRegistry, RpcError, Server, ServerHandle};
use serde_json::Value;

#[rpc::service(name = "ctl.Echo")]
trait Echo {
    #[governance(timeout_ms = 800)]
    async fn echo(&self, text: String) -> Result<String, RpcError>;
}

struct Plain;

impl Echo for Plain {
    async fn echo(&self, text: String) -> Result<String, RpcError> {
        Ok(text)
    }
}

const TOKEN: &str = "ctl-token";

struct Process {
    server: ServerHandle,
    client: Client,
    admin: AdminHandle,
}

/// A server, a client that called `ctl.Echo.echo` once (with a runtime update of its
/// retries), and the admin endpoint of both.
async fn process() -> Process {
    let registry = InProcessRegistry::new();
    let server = Server::builder()
        .registry(registry.clone())
        .add_service(EchoServer::new(Plain))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let client = Client::builder().registry(registry).build();
    EchoClient::new(client.clone())
        .echo("hi".into())
        .await
        .expect("call");
    client
        .update_options(
            "ctl.Echo.echo",
            GovernanceOverrides {
                retry_times: Some(1),
                ..GovernanceOverrides::NONE
            },
        )
        .expect("update");
    let admin = Admin::builder()
        .client(&client)
        .server(&server)
        .token(TOKEN)
        .serve("127.0.0.1:0")
        .await
        .expect("admin");
    Process {
        server,
        client,
        admin,
    }
}

/// rpcctl with `args`, with no admin address or token from the environment.
fn command(args: &[String]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_rpcctl"));
    command
        .args(args)
        .env_remove("RPCCTL_ADMIN")
        .env_remove("RPCCTL_TOKEN");
    command
}

/// Runs rpcctl with `args` to its end.
async fn rpcctl(args: Vec<String>) -> Output {
    run(command(&args)).await
}

/// Runs `command` to its end; a test that stops waiting (its timeout) kills it.
async fn run(command: Command) -> Output {
    tokio::process::Command::from(command)
        .kill_on_drop(true)
        .output()
        .await
        .expect("run rpcctl")
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_breakers_endpoint_health_and_options_as_tables_and_json() {
    let p = process().await;
    let addr = p.admin.local_addr().to_string();
    let endpoint = p.server.address().to_string();

    let o = rpcctl(args(&["--admin", &addr, "--token", TOKEN, "status"])).await;
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("readiness: ready"), "{out}");
    let row = |first: &str| {
        out.lines()
            .find(|l| l.starts_with(first))
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .unwrap_or_else(|| panic!("no row {first}:\n{out}"))
    };
    assert_eq!(row("ctl.Echo.echo  ")[..2], ["ctl.Echo.echo", "closed"]);
    assert_eq!(row(&endpoint)[..3], [endpoint.as_str(), "healthy", "0"]);
    let options: Vec<Vec<&str>> = out
        .lines()
        .filter(|l| l.starts_with("ctl.Echo.echo") && l.split_whitespace().count() == 4)
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert!(
        options.contains(&vec!["ctl.Echo.echo", "retry_times", "1", "runtime"]),
        "{out}"
    );
    assert!(
        options.contains(&vec!["ctl.Echo.echo", "timeout_ms", "800", "published"]),
        "{out}"
    );

    // The client isolates the entry: the next status says so, in JSON too.
    p.client.isolate_entry("ctl.Echo.echo").expect("isolate");
    let o = rpcctl(args(&[
        "--admin", &addr, "--token", TOKEN, "--json", "status",
    ]))
    .await;
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).expect("one JSON object");
    assert_eq!(v["breakers"][0]["entry"], "ctl.Echo.echo");
    assert_eq!(v["breakers"][0]["state"], "isolated");
    assert_eq!(v["endpoints"][0]["address"], endpoint.as_str());
    assert_eq!(
        v["entries"][0]["options"]["retry_times"]["level"],
        "runtime"
    );
    assert_eq!(v["ready"], "ready");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_exits_2_for_a_wrong_token_or_no_address_and_1_for_an_unreachable_one() {
    let p = process().await;
    let addr = p.admin.local_addr().to_string();
    let o = rpcctl(args(&["--admin", &addr, "--token", "wrong", "status"])).await;
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("wrong token"), "{}", stderr(&o));
    let o = rpcctl(args(&["status"])).await;
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--admin"), "{}", stderr(&o));
    // A port nothing listens on: bound, then released.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed_addr = closed.local_addr().unwrap().to_string();
    drop(closed);
    let o = rpcctl(args(&["--admin", &closed_addr, "status"])).await;
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("cannot reach"), "{}", stderr(&o));
    // An address that is none is the command line's fault.
    for wrong in ["127.0.0.1:99999", "a b:1"] {
        let o = rpcctl(args(&["--admin", wrong, "status"])).await;
        assert_eq!(o.status.code(), Some(2), "{wrong}: {}", stderr(&o));
        assert!(stderr(&o).contains("not an address"), "{}", stderr(&o));
    }
    // So is one every route would miss: no port (port 80), or the console's link, whose
    // fragment would take every route to the console's page.
    let console = format!("http://{addr}/#token={TOKEN}");
    for (wrong, said) in [
        ("127.0.0.1", "no port"),
        (console.as_str(), "without a path, query or fragment"),
        (&*format!("http://{addr}/api"), "without a path"),
        (&*format!("https://{addr}"), "plain HTTP"),
    ] {
        let o = rpcctl(args(&["--admin", wrong, "--token", TOKEN, "status"])).await;
        assert_eq!(o.status.code(), Some(2), "{wrong}: {}", stderr(&o));
        assert!(stderr(&o).contains(said), "{wrong}: {}", stderr(&o));
    }
    // A trailing slash names the same endpoint, with the scheme or without.
    for same in [format!("{addr}/"), format!("http://{addr}/")] {
        let o = rpcctl(args(&["--admin", &same, "--token", TOKEN, "status"])).await;
        assert!(o.status.success(), "{same}: {}", stderr(&o));
        assert!(stdout(&o).contains("readiness: ready"), "{}", stdout(&o));
    }
    // A token read from a file with its line break cannot go in a header.
    let o = rpcctl(args(&[
        "--admin",
        &addr,
        "--token",
        "ctl-token\r",
        "status",
    ]))
    .await;
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("line break"), "{}", stderr(&o));
}

/// The admin request carries the token: it goes straight to the endpoint, never through a
/// proxy the environment names (which would see the token, and reach its own loopback).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_goes_straight_to_the_endpoint_whatever_proxy_the_environment_names() {
    let p = process().await;
    let addr = p.admin.local_addr().to_string();
    // A "proxy" that never accepts: a connection to it would wait in its backlog.
    let proxy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let proxy_url = format!("http://{}", proxy.local_addr().unwrap());
    let mut command = command(&args(&["--admin", &addr, "--token", TOKEN, "status"]));
    for name in ["HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"] {
        command.env(name, &proxy_url);
    }
    command.env_remove("NO_PROXY").env_remove("no_proxy");
    let o = run(command).await;
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("readiness: ready"), "{}", stdout(&o));
    proxy.set_nonblocking(true).unwrap();
    let reached = proxy.accept();
    assert!(
        matches!(&reached, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the proxy was connected to: {reached:?}"
    );
}

/// `rpcctl status | head -1`: the reader goes away before rpcctl writes, and rpcctl ends
/// quietly with 0, as `events` does, rather than panicking on the closed pipe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_ends_quietly_with_0_when_its_reader_goes_away() {
    let p = process().await;
    let addr = p.admin.local_addr().to_string();
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let mut command = command(&args(&["--admin", &addr, "--token", TOKEN, "status"]));
    command.stdout(writer);
    let o = run(command).await;
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
}

/// `rpcctl events | head -1` on a quiet process: the reader goes away with no event to write.
/// rpcctl learned of a closed pipe only when writing, so it followed the stream for good (the
/// endpoint's keep-alives write nothing); it now watches its output while it waits, and ends
/// quietly with 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_ends_quietly_with_0_when_its_reader_goes_away_between_events() {
    let p = process().await;
    let addr = p.admin.local_addr().to_string();
    let (reader, writer) = std::io::pipe().expect("pipe");
    let mut child = command(&args(&["--admin", &addr, "--token", TOKEN, "events"]))
        .stdout(writer)
        .stderr(Stdio::piped())
        .spawn()
        .expect("start rpcctl events");
    until_following(lines_of(child.stderr.take().expect("stderr"))).await;
    drop(reader);
    // Bounded past the endpoint's 15 s keep-alive.
    let status = tokio::task::spawn_blocking(move || wait_within(child, Duration::from_secs(20)))
        .await
        .expect("join")
        .expect("rpcctl events ends once its reader is gone");
    assert_eq!(status.code(), Some(0));
}

/// An endpoint whose answers announce a body of 100 bytes and never send it: a 503 on every
/// path, or (`readyz_answers`) a whole `ready` on `/readyz` and that 503 elsewhere. Stalled
/// connections stay open until the test process ends.
fn stalling_endpoint(readyz_answers: bool) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let mut stalled = Vec::new();
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let mut head = [0u8; 4096];
            let n = std::io::Read::read(&mut conn, &mut head).unwrap_or(0);
            let asked = String::from_utf8_lossy(&head[..n]).into_owned();
            if readyz_answers && asked.starts_with("GET /readyz ") {
                let _ = std::io::Write::write_all(
                    &mut conn,
                    b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\nready",
                );
                continue;
            }
            let _ = std::io::Write::write_all(
                &mut conn,
                b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 100\r\n\r\n",
            );
            stalled.push(conn);
        }
    });
    addr
}

/// An endpoint that answers, then never sends the body it announced: rpcctl gives up after
/// `--admin-timeout-ms` with exit code 1, naming the request, whether the stalled body is
/// readiness's or an error answer's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_gives_up_on_an_answer_whose_body_never_comes() {
    for readyz_answers in [false, true] {
        let addr = stalling_endpoint(readyz_answers);
        let o = tokio::time::timeout(
            Duration::from_secs(30),
            rpcctl(args(&[
                "--admin",
                &addr,
                "--admin-timeout-ms",
                "300",
                "status",
            ])),
        )
        .await
        .expect("rpcctl status still waits after 30 s");
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(
            err.contains("did not answer") && err.contains("300 ms"),
            "{err}"
        );
        assert_eq!(err.contains("/readyz"), !readyz_answers, "{err}");
    }
}

/// A process that accepts connections but never answers (stopped, its runtime blocked): the
/// kernel completes the TCP handshake, so only a timeout ends the wait. `status` and `events`
/// exit 1 after `--admin-timeout-ms`, saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_events_give_up_on_an_endpoint_that_never_answers() {
    // Bound and listening, never accepted from: connects complete, nothing is ever read.
    let frozen = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = frozen.local_addr().unwrap().to_string();
    for command in ["status", "events"] {
        let o = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            rpcctl(args(&[
                "--admin",
                &addr,
                "--admin-timeout-ms",
                "300",
                command,
            ])),
        )
        .await
        .unwrap_or_else(|_| panic!("rpcctl {command} still waits after 30 s"));
        assert_eq!(o.status.code(), Some(1), "{command}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("did not answer") && stderr(&o).contains("300 ms"),
            "{command}: {}",
            stderr(&o)
        );
    }
    drop(frozen);
}

/// The lines `from` gives, read on a thread of their own as they come.
fn lines_of(from: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(from).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    rx
}

/// Waits (at most 20 s, off the runtime's threads) until rpcctl's standard error, read by
/// `stderr`, says it follows the event stream; then `stderr`, for what it says next.
async fn until_following(stderr: mpsc::Receiver<String>) -> mpsc::Receiver<String> {
    let (following, stderr) = tokio::task::spawn_blocking(move || {
        let line = stderr
            .recv_timeout(Duration::from_secs(20))
            .expect("rpcctl says it follows the stream");
        (line, stderr)
    })
    .await
    .expect("join");
    assert!(following.contains("following"), "{following}");
    stderr
}

/// Starts `rpcctl events --count 1` and returns once it follows the stream (its standard
/// error says so), with its standard output's lines and whether it exited 0 (within 20 s).
async fn follow(addr: &str, json: bool) -> (mpsc::Receiver<String>, tokio::task::JoinHandle<bool>) {
    follow_for(addr, json, Some(1)).await
}

/// [`follow`] with `--count` given when `count` is.
async fn follow_for(
    addr: &str,
    json: bool,
    count: Option<usize>,
) -> (mpsc::Receiver<String>, tokio::task::JoinHandle<bool>) {
    let mut a = args(&["--admin", addr, "--token", TOKEN, "events"]);
    if let Some(count) = count {
        a.extend(["--count".to_string(), count.to_string()]);
    }
    if json {
        a.insert(0, "--json".into());
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_rpcctl"))
        .args(&a)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start rpcctl events");
    let out_rx = lines_of(child.stdout.take().expect("stdout"));
    until_following(lines_of(child.stderr.take().expect("stderr"))).await;
    let exit = tokio::task::spawn_blocking(move || {
        wait_within(child, Duration::from_secs(20)).is_some_and(|s| s.success())
    });
    (out_rx, exit)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_prints_the_event_the_process_emits_once_following() {
    let p = process().await;
    let addr = p.admin.local_addr().to_string();

    let (lines, exit) = follow(&addr, true).await;
    p.client.isolate_entry("ctl.Echo.echo").expect("isolate");
    assert!(exit.await.expect("join"), "rpcctl events --count 1 exits 0");
    let line = lines
        .recv_timeout(Duration::from_secs(5))
        .expect("one line");
    let e: Value = serde_json::from_str(&line).expect("a JSON object per line");
    assert_eq!(
        (e["side"].as_str(), e["kind"].as_str()),
        (Some("client"), Some("isolate"))
    );
    assert_eq!(e["entry"], "ctl.Echo.echo");

    let (lines, exit) = follow(&addr, false).await;
    p.client
        .reset_breaker_entry("ctl.Echo.echo")
        .expect("reset");
    assert!(exit.await.expect("join"));
    let line = lines
        .recv_timeout(Duration::from_secs(5))
        .expect("one line");
    assert!(
        line.contains("client reset ctl.Echo.echo: reset by an operator"),
        "{line}"
    );
}

/// Following until the process stops is what `rpcctl events` without `--count` is for: the
/// endpoint ending the stream as it stops is exit 0; with a count not reached, exit 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_exits_0_when_the_followed_process_stops_and_1_short_of_its_count() {
    for (count, ends_well) in [(None, true), (Some(5), false)] {
        let p = process().await;
        let addr = p.admin.local_addr().to_string();
        let (_lines, exit) = follow_for(&addr, false, count).await;
        p.admin.shutdown().await;
        assert_eq!(
            exit.await.expect("join"),
            ends_well,
            "--count {count:?}: exit 0 is {ends_well}"
        );
        p.server.shutdown().await;
    }
}

/// `rpcctl events > /dev/full`: an output it cannot write is a failure (exit 1, saying so),
/// not the quiet end a reader going away (a closed pipe) gets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_exits_1_when_it_cannot_write_its_output() {
    let p = process().await;
    let addr = p.admin.local_addr().to_string();
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("/dev/full");
    let mut child = command(&args(&[
        "--admin", &addr, "--token", TOKEN, "events", "--count", "1",
    ]))
    .stdout(full)
    .stderr(Stdio::piped())
    .spawn()
    .expect("start rpcctl events");
    let err_rx = until_following(lines_of(child.stderr.take().expect("stderr"))).await;
    p.client.isolate_entry("ctl.Echo.echo").expect("isolate");
    let said = err_rx
        .recv_timeout(Duration::from_secs(20))
        .expect("rpcctl says why it stopped");
    assert!(said.contains("cannot write"), "{said}");
    let status = tokio::task::spawn_blocking(move || child.wait().expect("wait"))
        .await
        .expect("join");
    assert_eq!(status.code(), Some(1));
}
