//! Chaos: two of three server processes are killed with SIGKILL while callers keep a steady load
//! on them.
//!
//! Proves that an idempotent entry loses no call while one server lives (every call that met a
//! dead server is repeated on another), and that an entry that is not idempotent fails only
//! calls that may have been delivered: each failure is a communication error flagged
//! `is_maybe_delivered`, says so in its text, names a killed server as the last one tried, ended
//! after that server was killed, and there are no more of them than calls of the entry in flight
//! while the servers died. Both entries run with default governance: such failures are the dead
//! endpoint's, not the service's, so the entry's circuit breaker does not open on them.
//!
//! The servers are `chaos-server` processes (`tests/src/bin/chaos-server.rs`). Before the load
//! starts, every server holds a `park` call that never answers (it prints `parked`), so each kill
//! is sure to interrupt a call that is not idempotent. The kills happen at fixed points of the
//! call count: the caller that completes call number k hands the kill to a thread of its own,
//! which sends SIGKILL at once and reaps the process.

use crate::common;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{within, LIMIT};
use rpc::{Client, RpcError, StaticRegistry, StatusCode};
use tests::chaos::{Chaos, ChaosClient};
use tokio::sync::mpsc;

/// Callers per entry (`read` and `write`), each with one call in flight at a time.
const CALLERS: u64 = 6;
/// Calls made by all callers together: enough for load before, between and after the kills
/// (each kill interrupts the calls in flight and the parked one; more calls add no case).
const CALLS: u64 = 2_400;
/// Server `i` is killed once `KILL_AT[i]` calls have completed; server 2 survives.
const KILL_AT: [u64; 2] = [600, 1_200];
/// Upper bound of the whole load: no call starts after it.
const LOAD_LIMIT: Duration = Duration::from_secs(30);

/// A `chaos-server` process; killed (SIGKILL) and reaped on drop.
struct ServerProc {
    child: Child,
    addr: String,
    pid: u32,
}

impl ServerProc {
    /// Starts one server and waits for its address; later lines of its output go to `lines`,
    /// tagged with `index`.
    fn start(index: usize, lines: mpsc::UnboundedSender<(usize, String)>) -> ServerProc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_chaos-server"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start chaos-server");
        let stdout = child.stdout.take().expect("piped stdout");
        let (first_tx, first_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stdout).lines();
            if let Some(Ok(first)) = reader.next() {
                let _ = first_tx.send(first);
            }
            // Ends when the process dies and the pipe closes.
            for line in reader.map_while(Result::ok) {
                let _ = lines.send((index, line));
            }
        });
        let pid = child.id();
        // Built before waiting, so that the process is killed if the wait fails.
        let mut server = ServerProc {
            child,
            addr: String::new(),
            pid,
        };
        let first = first_rx
            .recv_timeout(LIMIT)
            .unwrap_or_else(|_| panic!("chaos-server {index} printed no address within {LIMIT:?}"));
        server.addr = first
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line of chaos-server: {first:?}"))
            .to_string();
        server
    }
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// When a server was killed: from the signal to the reaped process.
#[derive(Debug, Clone)]
struct Kill {
    addr: String,
    sent: Instant,
    reaped: Instant,
    /// Calls completed when the kill was asked for.
    at: u64,
}

impl Kill {
    /// Whether a call running from `start` to `end` was in flight while the server died.
    fn overlaps(&self, r: &Record) -> bool {
        r.start <= self.reaped && r.end >= self.sent
    }
}

/// Kills the victims on request, on a thread of its own so that no scheduling delay of the test's
/// runtime comes between the k-th completed call and the signal. Owns the victims: they are
/// killed when it ends, whatever happened.
fn killer(
    mut victims: Vec<ServerProc>,
) -> (
    std::sync::mpsc::Sender<(usize, u64)>,
    std::thread::JoinHandle<Vec<Kill>>,
) {
    let (tx, rx) = std::sync::mpsc::channel::<(usize, u64)>();
    let thread = std::thread::spawn(move || {
        let mut kills = Vec::new();
        // Ends when every sender is gone; at most one request per victim is honoured.
        while let Ok((i, at)) = rx.recv() {
            let victim = &mut victims[i];
            let sent = Instant::now();
            victim.child.kill().expect("SIGKILL chaos-server");
            victim.child.wait().expect("reap chaos-server");
            kills.push(Kill {
                addr: victim.addr.clone(),
                sent,
                reaped: Instant::now(),
                at,
            });
        }
        kills
    });
    (tx, thread)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    Read,
    Write,
    Park,
}

/// One finished call, with when it started and ended.
struct Record {
    entry: Entry,
    n: u64,
    start: Instant,
    end: Instant,
    result: Result<(u64, u32), RpcError>,
}

struct Load {
    next: AtomicU64,
    completed: AtomicU64,
    kill: std::sync::Mutex<Option<std::sync::mpsc::Sender<(usize, u64)>>>,
    stop_at: Instant,
}

async fn caller(chaos: ChaosClient, entry: Entry, load: Arc<Load>) -> Vec<Record> {
    let mut records = Vec::new();
    // Bounded by CALLS in count and by `stop_at` in time.
    loop {
        let n = load.next.fetch_add(1, Ordering::Relaxed);
        if n >= CALLS || Instant::now() >= load.stop_at {
            return records;
        }
        let start = Instant::now();
        let result = match entry {
            Entry::Read => chaos.read(n).await,
            _ => chaos.write(n).await,
        };
        records.push(Record {
            entry,
            n,
            start,
            end: Instant::now(),
            result,
        });
        let done = load.completed.fetch_add(1, Ordering::AcqRel) + 1;
        if let Some(victim) = KILL_AT.iter().position(|&k| k == done) {
            let kill = load.kill.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(kill) = kill.as_ref() {
                let _ = kill.send((victim, done));
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_servers_under_load_fails_only_calls_that_may_have_been_delivered() {
    let (lines_tx, mut lines) = mpsc::unbounded_channel();
    let mut servers: Vec<ServerProc> = (0..3)
        .map(|i| ServerProc::start(i, lines_tx.clone()))
        .collect();
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let pids: Vec<u32> = servers.iter().map(|s| s.pid).collect();
    let chaos = ChaosClient::new(
        Client::builder()
            .registry(StaticRegistry::new(addrs.clone()))
            .build(),
    );
    // Every server answers, then holds a call that never returns (park calls go round robin;
    // bounded: at most 9 of them).
    for i in 0..3 {
        within("warm-up", chaos.read(i))
            .await
            .expect("warm-up read");
    }
    let mut parks = Vec::new();
    let mut parked_on = BTreeSet::new();
    while parked_on.len() < 3 && parks.len() < 9 {
        let start = Instant::now();
        parks.push((
            start,
            tokio::spawn({
                let chaos = chaos.clone();
                async move {
                    let result = chaos.park().await;
                    (result, Instant::now())
                }
            }),
        ));
        let (index, line) = within("a park call entered a server", lines.recv())
            .await
            .expect("server output");
        assert_eq!(line, "parked", "unexpected output of server {index}");
        parked_on.insert(index);
    }
    assert_eq!(parked_on.len(), 3, "every server holds a parked call");

    let survivor = servers.pop().expect("three servers");
    let (kill_tx, kill_thread) = killer(servers);
    let load = Arc::new(Load {
        next: AtomicU64::new(0),
        completed: AtomicU64::new(0),
        kill: std::sync::Mutex::new(Some(kill_tx)),
        stop_at: Instant::now() + LOAD_LIMIT,
    });
    let mut callers = Vec::new();
    for entry in [Entry::Read, Entry::Write] {
        for _ in 0..CALLERS {
            callers.push(tokio::spawn(caller(chaos.clone(), entry, load.clone())));
        }
    }
    let mut records = Vec::new();
    for c in callers {
        records.extend(
            tokio::time::timeout(LOAD_LIMIT + LIMIT, c)
                .await
                .expect("callers finish")
                .expect("join"),
        );
    }
    // No more kills: the thread ends and hands back when each victim died.
    drop(load.kill.lock().unwrap_or_else(|p| p.into_inner()).take());
    let kills = kill_thread.join().expect("killer thread");
    assert_eq!(
        records.len() as u64,
        CALLS,
        "the load did not complete within {LOAD_LIMIT:?}"
    );
    assert_eq!(kills.len(), 2, "both kills happened: {kills:?}");
    for k in &kills {
        eprintln!("killed {} after {} completed calls", k.addr, k.at);
    }

    // Parked calls: those on a killed server fail (checked below with the writes); the one on
    // the survivor is still waiting.
    let mut parked = Vec::new();
    for (start, park) in parks {
        if park.is_finished() {
            let (result, end) = park.await.expect("join");
            parked.push(Record {
                entry: Entry::Park,
                n: 0,
                start,
                end,
                result: result.map(|pid| (0, pid)),
            });
        } else {
            park.abort();
        }
    }
    assert!(
        parked.len() >= 2,
        "each kill ended the call parked on its victim"
    );

    // Idempotent: every call succeeded, with its own answer.
    let read_failures: Vec<String> = records
        .iter()
        .filter(|r| r.entry == Entry::Read)
        .filter_map(|r| match &r.result {
            Ok((n, _)) if *n == r.n => None,
            Ok(other) => Some(format!("read {}: wrong answer {other:?}", r.n)),
            Err(e) => Some(format!("read {}: {e}", r.n)),
        })
        .collect();
    assert!(
        read_failures.is_empty(),
        "{} idempotent calls failed while a server lived, e.g. {:?}",
        read_failures.len(),
        &read_failures[..read_failures.len().min(5)]
    );

    // Not idempotent: each failure may have been delivered, and says so.
    let non_idempotent: Vec<&Record> = records
        .iter()
        .filter(|r| r.entry == Entry::Write)
        .chain(parked.iter())
        .collect();
    let mut failed = 0usize;
    for r in &non_idempotent {
        let e = match &r.result {
            Ok((n, _)) => {
                assert!(
                    r.entry != Entry::Write || *n == r.n,
                    "write {}: wrong answer {n}",
                    r.n
                );
                continue;
            }
            Err(e) => e,
        };
        failed += 1;
        let what = format!("{:?} {}", r.entry, r.n);
        assert_eq!(e.code(), StatusCode::CommunicationError, "{what}: {e}");
        assert!(e.is_maybe_delivered(), "{what}: not flagged: {e}");
        assert!(
            e.to_string().contains("may have been delivered"),
            "{what}: the text must say it may have run: {e}"
        );
        let last = e.tried().last().expect("a failed call names where it went");
        let kill = kills
            .iter()
            .find(|k| &k.addr == last)
            .unwrap_or_else(|| panic!("{what} failed on {last}, a live server: {e}"));
        assert!(
            r.end >= kill.sent,
            "{what} failed before its server {last} was killed: {e}"
        );
    }
    let in_flight: usize = kills
        .iter()
        .map(|k| non_idempotent.iter().filter(|r| k.overlaps(r)).count())
        .sum();
    eprintln!(
        "non-idempotent calls: {} made, {failed} failed (may have been delivered), {in_flight} \
         in flight while servers died",
        non_idempotent.len()
    );
    // Each kill interrupted the call parked on its victim: one failed parked call per kill,
    // last tried there (flagged as maybe delivered, checked above).
    for k in &kills {
        let interrupted = parked
            .iter()
            .filter(|r| matches!(&r.result, Err(e) if e.tried().last() == Some(&k.addr)))
            .count();
        assert_eq!(
            interrupted, 1,
            "the call parked on {} ended with it",
            k.addr
        );
    }
    assert!(
        failed <= in_flight,
        "{failed} non-idempotent calls failed, more than the {in_flight} in flight at the kills"
    );

    // After the second kill only the survivor answers, and the load really went on.
    let last_kill = kills.last().expect("two kills");
    let after: Vec<&Record> = records
        .iter()
        .filter(|r| r.start > last_kill.reaped)
        .collect();
    assert!(
        after.len() as u64 >= CALLS / 4,
        "only {} calls after the second kill",
        after.len()
    );
    for r in after {
        if let Ok((_, pid)) = &r.result {
            assert_eq!(
                *pid, survivor.pid,
                "{:?} {} answered by a dead server (pids {pids:?})",
                r.entry, r.n
            );
        }
    }
    drop(survivor);
}
