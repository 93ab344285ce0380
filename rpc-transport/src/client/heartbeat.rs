//! The deadline sweeper and the heartbeat of a connection.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rpc_core::wire::{frame::Kind, Cancel, Ping};
use rpc_core::{RpcError, StatusCode};

use super::pending::NO_SWEEP;
use super::shared::Shared;

/// Fails calls whose deadline passed with [`StatusCode::Timeout`] and sends `Cancel` for them.
/// Sleeps until the earliest deadline, so a connection whose calls all answer in time costs one
/// timer per earliest-deadline change, not one per call.
/// Ends with the connection (the reader cancels `close` whenever it stops).
pub(super) async fn sweeper(s: Arc<Shared>) {
    let closing = s.close.clone();
    let closing = closing.cancelled();
    tokio::pin!(closing);
    // Reused from sweep to sweep.
    let mut expired = Vec::new();
    loop {
        let next = s.next_sweep.load(Ordering::Acquire);
        let wake = wake_at(s.epoch, next);
        tokio::select! {
            _ = &mut closing => return,
            _ = s.sweep.notified() => continue,
            _ = tokio::time::sleep_until(wake), if next != NO_SWEEP => {}
        }
        let now_ms = s.epoch.elapsed().as_millis() as u64;
        if now_ms < s.next_sweep.load(Ordering::Acquire) {
            continue;
        }
        s.next_sweep.store(NO_SWEEP, Ordering::Release);
        expired.clear();
        let next = s.pending.expire(
            now_ms,
            || {
                RpcError::new(
                    StatusCode::Timeout,
                    format!(
                        "{}: no answer before the call's deadline; the server was told to stop",
                        s.peer
                    ),
                )
            },
            &mut expired,
        );
        s.next_sweep.fetch_min(next, Ordering::AcqRel);
        if !expired.is_empty() {
            // Between the expiry and the Cancels: see `Shared::cancel_again_if_swept`.
            s.sweeps.fetch_add(1, Ordering::SeqCst);
        }
        for &id in &expired {
            s.sender.send(Kind::Cancel(Cancel {
                message_id: id,
                ..Default::default()
            }));
        }
    }
}

/// When the sweeper wakes for the earliest deadline `next` (ms since the connection's
/// `epoch`). Any deadline is taken as it is: a connection lives longer than `u32::MAX` ms
/// (49.7 days), and a wake capped below a later deadline would return at once, again and
/// again, spinning until that deadline. Only [`NO_SWEEP`] (no deadline; its branch is not
/// polled then) is capped, to a time `Instant` can still hold.
fn wake_at(epoch: tokio::time::Instant, next: u64) -> tokio::time::Instant {
    /// About 285 000 years.
    const FAR: u64 = 1 << 53;
    epoch + Duration::from_millis(next.min(FAR))
}

/// How often a connection without heartbeats still counts a beat for its streams (see
/// [`beats_only`]): well within a server's idle timeout (60 s by default).
pub(super) const STREAM_BEAT: Duration = Duration::from_secs(10);

/// Counts a beat every `interval` and nothing else, for a connection without heartbeats
/// whose streams still need them: a slow consumer grants what it took at its next take after
/// a beat (`Shared::beats`), and without beats it granted only at half its window, so a
/// server waiting that long for credit took the stream for stalled and ended it.
pub(super) async fn beats_only(shared: std::sync::Weak<Shared>, interval: Duration) {
    while beat(&shared, interval).await.is_some() {}
}

/// Waits `interval` and counts a beat of the connection; `None` once it is closed or gone.
async fn beat(shared: &std::sync::Weak<Shared>, interval: Duration) -> Option<Arc<Shared>> {
    let close = shared.upgrade()?.close.clone();
    tokio::select! {
        _ = close.cancelled() => return None,
        _ = tokio::time::sleep(interval) => {}
    }
    let s = shared.upgrade()?;
    s.beats.fetch_add(1, Ordering::Relaxed);
    Some(s)
}

/// Pings every `interval`; closes the connection when nothing at all arrived during three
/// intervals in a row (a counter the decoder bumps for every arrival, a frame whole or in
/// part, is compared, so the reader never reads the clock).
pub(super) async fn heartbeat(
    shared: std::sync::Weak<Shared>,
    interval: Duration,
    received: Arc<AtomicU64>,
) {
    let mut nonce = 0u64;
    let mut last_count = received.load(Ordering::Relaxed);
    let mut silent_ticks = 0u32;
    // What the socket had taken at the last beat, and whether frames were waiting then.
    let mut last_sent = None;
    let mut queued = false;
    while let Some(s) = beat(&shared, interval).await {
        let count = received.load(Ordering::Relaxed);
        // A server taking a long queue of the client's frames is alive, however slowly it
        // reads: its answers and its `Pong` come after the frames queued before them. (With
        // nothing queued, the beats' own `Ping`s say nothing of the server: the socket takes
        // them whether or not anyone reads them.)
        let backlog = s.sender.backlog();
        let sent = backlog.sent();
        let taking = queued && last_sent.is_some_and(|last| sent != last);
        last_sent = Some(sent);
        queued = backlog.bytes() > 0;
        if count == last_count && !taking {
            silent_ticks += 1;
        } else {
            silent_ticks = 0;
            last_count = count;
        }
        if silent_ticks >= 3 {
            let reason = format!(
                "no traffic from the server for three heartbeats ({} ms): the connection was \
                 taken for dead and closed",
                3 * interval.as_millis()
            );
            tracing::warn!(peer = %s.peer, "{reason}");
            let _ = s.close_reason.set(reason);
            s.closed.store(true, Ordering::Release);
            s.close.cancel();
            return;
        }
        nonce += 1;
        s.sender.send(Kind::Ping(Ping { nonce }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deadline more than `u32::MAX` ms after the connection started (a connection older
    /// than 49.7 days) is waited for as it is.
    #[test]
    fn a_deadline_past_49_7_days_is_waited_for_as_it_is() {
        let epoch = tokio::time::Instant::now();
        let fifty_days = 50 * 24 * 3600 * 1000;
        assert_eq!(
            wake_at(epoch, fifty_days) - epoch,
            Duration::from_millis(fifty_days)
        );
        assert!(wake_at(epoch, NO_SWEEP) > wake_at(epoch, fifty_days));
    }
}
