//! Overload at ten times the server's cap, wave after wave.
//!
//! Proves, without timing anything: with a cap of C and 10×C callers on a handler held by a gate
//! the test controls, exactly C calls run while the other 9×C are answered Overflow (515) at
//! once — before any held call is let go, so they were not queued behind them; the held calls
//! finish once released; the server then answers a call at once; and wave after wave the same
//! numbers hold, so nothing leaks: the cap's slots come back (C run again), the handlers end
//! (none left running) and the connection's count of running calls returns to zero (its limit
//! is set to C + 1, so a leak of even one would refuse a call of the next wave "per
//! connection" instead of at the cap).
//!
//! The figures that need a clock (latency of admitted calls and of Overflow answers, server
//! memory) are printed by `examples/src/bin/hardening.rs`, not asserted here.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::{no_retry, recv_one, within};
use rpc::{Client, GovernanceOverrides, InProcessRegistry, RpcError, Server, StatusCode};
use tokio::sync::{mpsc, Semaphore};

#[rpc::service(name = "t.Overload")]
trait Overload {
    /// Reports entry, then waits for the gate.
    async fn hold(&self) -> Result<u64, RpcError>;
    /// Answers at once.
    async fn quick(&self) -> Result<u64, RpcError>;
}

/// The server's cap.
const CAP: usize = 8;
/// Callers per wave: ten times the cap.
const CALLERS: usize = 10 * CAP;
/// Waves of callers, one after the other.
const WAVES: usize = 5;

struct Gate {
    entered: mpsc::UnboundedSender<()>,
    release: Semaphore,
    /// Handlers running now.
    running: AtomicUsize,
    /// Handlers ever started.
    ran: AtomicUsize,
}

/// Counts a handler out however it ends.
struct Running<'a>(&'a AtomicUsize);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Overload for Gate {
    async fn hold(&self) -> Result<u64, RpcError> {
        self.running.fetch_add(1, Ordering::SeqCst);
        let _running = Running(&self.running);
        self.ran.fetch_add(1, Ordering::SeqCst);
        let _ = self.entered.send(());
        common::let_through(&self.release).await?;
        Ok(1)
    }
    async fn quick(&self) -> Result<u64, RpcError> {
        Ok(2)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_times_the_cap_gets_overflow_at_once_and_every_wave_leaves_nothing_behind() {
    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let gate = Arc::new(Gate {
        entered: entered_tx,
        release: Semaphore::new(0),
        running: AtomicUsize::new(0),
        ran: AtomicUsize::new(0),
    });
    let reg = InProcessRegistry::new();
    let server = Server::builder()
        .registry(reg.clone())
        .max_concurrency(CAP)
        .max_in_flight_per_connection(CAP + 1)
        .add_service(OverloadServer::from_arc(gate.clone()))
        .serve("127.0.0.1:0")
        .await
        .expect("serve");
    let client = OverloadClient::new(
        Client::builder()
            .registry(reg)
            .connections_per_endpoint(1)
            // Each refusal reaches the test as it is: no retry, and no client breaker (which
            // would open after three refusals and answer in the server's stead).
            .override_options(
                OverloadClient::SERVICE_ID,
                GovernanceOverrides {
                    enable_circuit_breaker: Some(false),
                    ..no_retry()
                },
            )
            .build(),
    );
    assert_eq!(client.quick().await.expect("quick before the load"), 2);

    for wave in 0..WAVES {
        let (done_tx, mut done) = mpsc::unbounded_channel();
        for _ in 0..CALLERS {
            let (client, done_tx) = (client.clone(), done_tx.clone());
            tokio::spawn(async move {
                let _ = done_tx.send(client.hold().await);
            });
        }
        // With every admitted call held, the calls over the cap come back, all Overflow.
        for i in 0..CALLERS - CAP {
            let err = recv_one("an overflowed call", &mut done)
                .await
                .expect_err("no held call can finish while the gate is closed");
            assert_eq!(
                err.code(),
                StatusCode::OverflowMaxServerHandle,
                "wave {wave}, answer {i}: {err}"
            );
            assert!(
                err.message().contains(&format!("cap of {CAP}")),
                "wave {wave}: refused at the server's cap, not elsewhere: {err}"
            );
        }
        for _ in 0..CAP {
            recv_one("an admitted call entered its handler", &mut entered).await;
        }
        assert_eq!(gate.running.load(Ordering::SeqCst), CAP, "wave {wave}");
        assert_eq!(
            gate.ran.load(Ordering::SeqCst),
            CAP * (wave + 1),
            "wave {wave}: overflowed calls never ran"
        );
        assert!(
            done.try_recv().is_err(),
            "wave {wave}: the admitted calls are still held"
        );
        assert!(
            entered.try_recv().is_err(),
            "wave {wave}: no call beyond the cap entered"
        );

        gate.release.add_permits(CAP);
        for _ in 0..CAP {
            let r = recv_one("a released call", &mut done).await;
            assert_eq!(r.expect("a released call succeeds"), 1, "wave {wave}");
        }
        assert_eq!(
            gate.running.load(Ordering::SeqCst),
            0,
            "wave {wave}: every handler ended"
        );
        assert_eq!(
            within("a call after the wave", client.quick())
                .await
                .expect("the server answers after the wave"),
            2
        );
    }
    within("shutdown", server.shutdown()).await;
}
