// The one declaration of every governance option: its name (the field, the TOML key and the
// `#[governance(...)]` key), its kind, its default, its policy, the side that applies it, the
// line of the README's options table, and its rustdoc.
//
// Two crates read this file with `include!`, each with its own `governance_options!` and
// `shunt_strategy_spellings!` macros: rpc-core (`options/mod.rs`) makes `GovernanceOptions`,
// its `Default`, `GovernanceOverrides` with `apply_to`/`merge`/`clear` and the `OPTIONS`
// descriptor table from it; rpc-macros (`src/keys.rs`) makes the keys and values
// `#[governance(...)]` accepts. The README's tables are checked against `OPTIONS`
// (`cargo test -p rpc-core --test readme_options`).
//
// Adding an option is one entry here, in its policy's block:
//
//     /// Rustdoc of the field.
//     name: kind = default, Side, "meaning, one line, for the README";
//
// Kinds: `u64`, `u32`, `percent` (a `u32` from 0 to 100), `flag` (a `bool` written
// `key = true | false`), `bare_flag` (also `#[governance(key)]` for `true`), `strategy`
// (a `ShuntStrategy`, written as one of its spellings below), `compression` (a `Compression`,
// written as one of its spellings below) and `address` (an optional `host:port`). Side: `Client`, `Server` or `Both`. Then the policy that reads the option uses
// the new field; nothing else changes.

governance_options! {
    Balance {
        /// Endpoint selection.
        shunt_strategy: strategy = RoundRobin, Client,
            "`polling`, `random`, `hash` (the `#[hash_key]` argument on a ring with virtual nodes), `appoint` (with `appoint_address`), `least_loaded` (alias `p2c`: the better of two random endpoints by peak-EWMA latency × √(calls in flight ÷ the instance's `weight` metadata) × the server's reported load; a refusal (Overflow, a rate limit) or a handler failure scores as a latency of at least 250 ms, however fast it came back)";
        /// The address used by [`ShuntStrategy::Appoint`], as `host:port`.
        appoint_address: address = None, Client,
            "the `host:port` (or `unix:/path`, a server's Unix socket) every call goes to under `shunt_strategy = appoint`";
        /// Slow start of instances the registry announces after this client first saw the
        /// service, in milliseconds: under `least_loaded` their weight ramps up from a tenth over
        /// this time. 0 turns it off.
        slow_start_ms: u64 = 0, Client,
            "under `least_loaded`, an instance announced after the client's first call ramps from a tenth of its weight over this time; 0 = off";
        /// Bounded-load consistent hashing, in percent of the mean: under `hash`, an endpoint
        /// with more outstanding calls than this share of the mean (rounded up) is walked past
        /// to the next one on the ring. 0 turns it off; 125 means no endpoint takes more than
        /// 1.25 × the mean; values from 1 to 100 act as 100.
        hash_balance_factor: u32 = 0, Client,
            "under `hash`, a key's owner holding more than this percentage of the mean outstanding calls is passed over for the next on the ring (125 = at most 1.25 × the mean); 0 = off";
        /// Outlier ejection by success rate (Envoy's rule): every `outlier_interval_ms`, an
        /// endpoint whose success rate lies more than `outlier_stdev_factor_percent` / 100
        /// standard deviations below its peers' mean is marked unhealthy.
        outlier_success_rate: flag = false, Client,
            "eject, every `outlier_interval_ms`, endpoints whose success rate lies far below their peers' (Envoy's success-rate rule), beside consecutive-failure marks";
        /// Outlier ejection: the interval calls are counted over, in milliseconds.
        outlier_interval_ms: u64 = 10000, Client,
            "the interval the success rates are counted over (judged at the first call after it ends; not judged when that call comes an interval or more late)";
        /// Outlier ejection: calls an endpoint must have served in the interval to be judged.
        outlier_request_volume: u32 = 100, Client,
            "calls an endpoint must have served in the interval to be judged";
        /// Outlier ejection: endpoints that must qualify before any is judged.
        outlier_minimum_hosts: u32 = 5, Client,
            "endpoints that must qualify before any is judged";
        /// Outlier ejection: standard deviations below the mean that make an outlier, in
        /// hundredths (190 = 1.9).
        outlier_stdev_factor_percent: u32 = 190, Client,
            "standard deviations below the mean that make an outlier, in hundredths (190 = 1.9)";
        /// Outlier ejection: at most this share of the endpoints (at least one) is ejected at
        /// once.
        outlier_max_ejection_percent: percent = 10, Client,
            "at most this share of the endpoints (at least one) is ejected at once, for `outlier_interval_ms`";
        /// Outlier ejection in observe mode: outliers are judged and reported (event
        /// `ejection` with `observed = true`) but stay in use.
        outlier_observe: flag = false, Client,
            "observe mode: outliers are judged and reported (event `ejection`, `observed = true`) but not ejected";
    }
    Timeout {
        /// Deadline of the whole call, retries included, in milliseconds; 0 means none.
        timeout_ms: u64 = 5000, Client,
            "deadline of the whole call, retries included; 0 = none. A call made inside a handler inherits what is left of its caller's budget, less `deadline_slack_ms`; its timeout message then says the budget was the caller's.";
        /// Deadline of each attempt, in milliseconds; 0 means none (an attempt may use what is left
        /// of `timeout_ms`). An attempt that runs out of it counts against its endpoint and, for an
        /// idempotent entry, is retried on another endpoint within the call's `timeout_ms`.
        attempt_timeout_ms: u64 = 0, Client,
            "deadline of each attempt; 0 = none. An attempt that runs out of it counts against its endpoint and, for an idempotent entry, is retried on another endpoint within `timeout_ms`";
        /// A call made while handling another call (B's call to C while B serves A) inherits what
        /// is left of the caller's deadline less this slack, in milliseconds, at most a quarter of
        /// what is left: B's own call times out early enough for B (its fallback, its error) to
        /// still answer A in time. Default 50 ms: a few round trips on a LAN plus a local
        /// fallback's work, and small against the default 5 s budget.
        deadline_slack_ms: u64 = 50, Client,
            "kept from an inherited budget (at most a quarter of it) so the middle tier (its fallback, its error) still answers its caller in time. A fallback does not start once its caller's deadline has passed (event `fallback_skipped`). A call that runs out of its caller's deadline (shorter than its own `timeout_ms`) is held against neither its endpoint nor its breaker: the caller had too little time left.";
    }
    Retry {
        /// Attempts after the first one, on Overflow or an unreachable endpoint.
        retry_times: u32 = 3, Client,
            "attempts after the first; no retry if the pause does not fit before the deadline";
        /// Pause before each retry, in milliseconds.
        retry_interval_ms: u64 = 50, Client,
            "the pause before each retry, in milliseconds";
        /// Retry budget: retries allowed as a percentage of the entry's calls over the last 10 s.
        retry_budget_percent: u32 = 20, Client,
            "retries stay below this share of the entry's calls over 10 s";
        /// Retry budget: retries always allowed, whatever the ratio says, as a rate per second
        /// counted over the budget's 10 s window (this × 10 retries in any 10 s, which may
        /// come at once, as Finagle's budget reserve does).
        retry_budget_min_per_second: u32 = 10, Client,
            "retries always allowed whatever the share says, per second counted over 10 s (this × 10 in any 10 s, which may come at once)";
        /// Chain stop: a call made while serving a call that a caller up the chain retries
        /// (attachment `rpc-retry-depth`) is not retried again, so retries do not multiply
        /// across hops (it still fails over from an endpoint it never reached: connection
        /// refused, nothing sent); `false` lets this entry retry anyway.
        retry_chain_stop: flag = true, Client,
            "a call made while serving a call some caller up the chain retries (attachment `rpc-retry-depth`) is not retried again, so a failing leaf is not hit `(1 + retries)` times per hop (failing over from an endpoint the call never reached stays allowed); `false` retries anyway";
        /// The method may run twice without harm: a call that may have reached a server that then
        /// died is repeated elsewhere.
        idempotent: bare_flag = false, Client,
            "a call that may have reached a server that then died is repeated elsewhere only when true; otherwise its error says it may have been delivered";
        /// Client-side adaptive throttling (the SRE rule), as K × 100: each attempt is dropped
        /// locally with probability `max(0, (requests − K · accepts) / (requests + 1))` over the
        /// last 10 s, where accepts are the server's answers other than an overload refusal.
        /// 0 turns it off; 200 is K = 2; values from 1 to 99 act as 100 (K below 1 would drop
        /// attempts a healthy server answers).
        throttle_k_percent: u32 = 0, Client,
            "adaptive throttling, K × 100 (200 = K of 2; 0 = off; 1 to 99 act as 100, K below 1 dropping calls a healthy server answers): an attempt is dropped locally (514, event `throttled`, not retried) with probability max(0, (requests − K·accepts) / (requests + 1)) over 10 s; accepts are answers other than an overload refusal (515, 429), an attempt without an answer (timeout, broken connection) is no accept, and one sent nowhere (its instance cannot serve the call) counts for nothing";
        /// Adaptive throttling in observe mode: an attempt the rule would drop is reported
        /// (event `throttled` with `observed = true`) and sent.
        throttle_observe: flag = false, Client,
            "observe mode: an attempt throttling would drop is reported (event `throttled`, `observed = true`) and sent";
        /// Hedging, for idempotent entries: when the first attempt has not answered after this
        /// many milliseconds, a second goes to another endpoint; the first answer wins and the
        /// other attempt is cancelled. A hedge draws on the retry budget. 0 turns it off
        /// (unless `hedge_percentile` is set; then this is the delay's floor).
        hedge_delay_ms: u64 = 0, Client,
            "idempotent entries only (0 = off, unless `hedge_percentile` is set): after this delay without an answer a second attempt goes to another endpoint (none when there is no other); the first answer (a success, or an error the callee answered) wins, the other is cancelled (Cancel frame); a hedge draws on the retry budget and is not sent once it is spent (event `hedge`); one that never leaves the client (throttled, refused by a per-attempt layer) gives it back";
        /// Hedging by percentile, for idempotent entries: when set (1 to 100), the hedge delay
        /// is the entry's latency at this percentile over the last 10 s, never less than
        /// `hedge_delay_ms`; until 20 calls were seen in that window the delay is
        /// `hedge_delay_ms` (no hedge when that is 0). 0 turns it off.
        hedge_percentile: percent = 0, Client,
            "idempotent entries only (0 = off): the hedge delay is the entry's latency at this percentile over the last 10 s (95 = p95), at least `hedge_delay_ms`; until 20 calls were seen the delay is `hedge_delay_ms` (none when 0)";
    }
    Breaker {
        /// Whether the entry has a circuit breaker.
        enable_circuit_breaker: flag = true, Client,
            "per entry, counting only failures that speak about the remote side";
        /// Consecutive counted failures the breaker tolerates before it opens.
        exceptions_allowed_before_breaking: u32 = 3, Client,
            "consecutive mode: opens after this many counted failures in a row";
        /// How long the breaker stays open, in seconds; also how long a round of half-open
        /// probes holds its slots when they never report back (at least a second). 0 probes as
        /// soon as the breaker opens.
        breaker_seconds: u64 = 60, Client,
            "how long an open breaker fails fast, in seconds (0: it probes at once); probes that never report back free their slots after as long, at least 1 s";
        /// Probe calls a half-open breaker admits at once.
        half_open_probes: u32 = 1, Client,
            "calls let through after the break; a success or the callee's own answer (business, validation, not found, auth) closes, a failure or timeout reopens, a cancelled or panicking probe, one a rate limit refused before any handler ran, or one answered 507 by an instance without the entry (the call moves to another), frees its slot at once";
        /// Failure-ratio mode of the breaker: it opens when this percentage of the calls in the
        /// sampling window failed (0 = consecutive mode, driven by
        /// `exceptions_allowed_before_breaking`).
        failure_ratio_percent: percent = 0, Client,
            "ratio mode (when set): opens when this share of the window's calls failed; 0 = consecutive mode";
        /// Failure-ratio mode: the window over which the ratio is computed, in seconds. It is
        /// counted per second up to a minute, and beyond in at most 60 buckets of
        /// `ceil(window / 60)` seconds, so a window of a day costs no more than one of a
        /// minute; an outcome leaves the window up to two buckets' width early, never late.
        sampling_window_seconds: u64 = 10, Client,
            "ratio mode: the window the share is computed over, in seconds";
        /// Failure-ratio mode: calls the window must hold before the ratio can open the breaker.
        minimum_throughput: u32 = 20, Client,
            "ratio mode: calls the window must hold before the share can open the breaker";
        /// The breaker in observe mode: it counts and changes state as usual (event `break`
        /// with `observed = true` when it would open), but an open breaker lets calls through.
        /// An operator's isolation is still enforced.
        breaker_observe: flag = false, Client,
            "observe mode: the breaker counts and opens as usual (event `break`, `observed = true`) but calls still pass while it is open; an operator's isolation still holds";
    }
    Health {
        /// Consecutive transport failures after which a client stops using an endpoint until the
        /// registry announces it again.
        unhealthy_times_allowed_before_removing: u32 = 3, Client,
            "transport failures in a row after which this client drops the endpoint (before that: unhealthy for 1 s, 2 s, 4 s …); a dropped endpoint is probed in the background (connect + handshake, 250 ms doubling to 30 s) and taken back when one succeeds or the registry announces it again";
    }
    Admission {
        /// Server side: calls of this entry handled at once before Overflow is answered (0: every
        /// call is answered Overflow).
        max_concurrent_handling_count: u32 = 50, Server,
            "the server cap, an admission count: calls over it get Overflow at once, none queue (per server via `max_concurrency`, per entry via the attribute); 0 refuses every call";
        /// Server side: calls of this entry admitted per second for all callers together (a
        /// token bucket); 0 means no limit. Calls over it are answered 429 with a retry-after.
        rate_limit_per_second: u32 = 0, Server,
            "calls per second the entry takes from all callers (token bucket); 0 = none. Over it: 429 at once, with `retry_after_ms` until the next token";
        /// Server side: the burst of `rate_limit_per_second`: calls admitted at once after a
        /// quiet spell (at least 1).
        rate_limit_burst: u32 = 10, Server,
            "the bucket's size: calls admitted at once after a quiet spell";
        /// Server side: calls of this entry admitted per second from each caller (keyed by the
        /// client id of its handshake); 0 means no quota.
        caller_rate_limit_per_second: u32 = 0, Server,
            "per-caller quota (by the handshake's client id), calls per second; 0 = none. Checked before the entry's limit, so a greedy caller does not spend other callers' tokens";
        /// Server side: the burst of `caller_rate_limit_per_second` (at least 1).
        caller_rate_limit_burst: u32 = 10, Server,
            "the burst of each caller's quota";
        /// Server side: the rate limits in observe mode: a call over a limit is reported
        /// (event `rate_limited` with `observed = true`) and admitted.
        rate_limit_observe: flag = false, Server,
            "observe mode for both rate limits: a call over one is reported (event `rate_limited`, `observed = true`) and admitted";
        /// Server side: the entry's admission uses an adaptive limit (gradient controller on
        /// measured latency) instead of the fixed cap, which becomes the limit's maximum.
        adaptive_concurrency: bare_flag = false, Server,
            "the cap adapts to measured latency (gradient rule), between `adaptive_min_limit` and the cap; over it 515 at once. Deadline-aware (a call with less budget than calls take now: 515 at once, while other calls of the entry run; with none running it is let through, to measure anew) and criticality-aware (attachment `rpc-criticality`: `critical`, `default`, `sheddable`; sheddable refused first)";
        /// Server side: the least the adaptive limit goes down to. Under a lasting overload
        /// the gradient rule's headroom (√limit) holds the limit at 4 or more; a minimum below
        /// 4 is reached only by the probes that measure the no-load latency.
        adaptive_min_limit: u32 = 4, Server,
            "the least the adaptive limit goes down to (its maximum is the cap); under a lasting overload the rule's headroom of √limit holds it at 4 or more, so a minimum below 4 is reached only while the no-load latency is measured anew";
        /// Server side: the cap or adaptive limit in observe mode: a call over it is reported
        /// (event `overflow` with `observed = true`) and admitted.
        admission_observe: flag = false, Server,
            "observe mode for the cap and the adaptive limit: a call over it is reported (event `overflow`, `observed = true`) and admitted";
    }
    Compression {
        /// How the entry's payloads are compressed on the wire: the client compresses the
        /// parameters, the server the results (a server whose option for the entry is `off`
        /// answers with the algorithm the call came with). Only payloads of at least
        /// `compression_threshold` bytes, only with an algorithm the peer listed in its
        /// handshake, and only when compressing makes them smaller.
        compression: compression = Off, Both,
            "`off`, `zstd` (Zstandard, level 1) or `lz4` (LZ4 block): payloads of at least `compression_threshold` bytes are compressed, parameters by the client, results by the server (whose `off` answers with the call's algorithm), when the peer's handshake lists the algorithm and it makes them smaller";
        /// The least size, in bytes, of a payload (encoded parameters or result) that is
        /// compressed under `compression`.
        compression_threshold: u32 = 1024, Both,
            "payloads (encoded parameters or result) of at least this many bytes are compressed";
    }
}

// The spellings of each `ShuntStrategy` accepted in config files and attributes. The first is
// the one error messages and the README show; serde writes the variant's `rename`.
shunt_strategy_spellings! {
    RoundRobin = "polling" | "round_robin" | "round-robin",
    Random = "random",
    Hash = "hash" | "hash_algorithm",
    Appoint = "appoint",
    LeastLoaded = "least_loaded" | "p2c" | "least-loaded",
}

// The spellings of each `Compression` accepted in config files and attributes. The first is the
// one error messages and the README show, and the one serde writes.
compression_spellings! {
    Off = "off",
    Zstd = "zstd",
    Lz4 = "lz4",
}
