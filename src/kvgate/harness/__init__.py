"""Real processes on 127.0.0.1 for the demo, the end-to-end tests and the benchmarks: one harness.

    processes   Service (a child process with its log), ProcessGroup (stops all it started),
                ChildError, wait_for_port; the commands for kvgate, `kvgate sim` and Envoy
    envoy       a shipped Envoy config with this run's ports (LOCAL_PORTS is the README's layout)
    stack       the gate, an agent and Envoy started and waited for, stopped for sure
    upstreams   recording HTTP upstreams, one per pool, on a background thread
    client      a blocking HTTP client for tests: post, chat, post_until_admitted

Everything here listens on 127.0.0.1 only and takes its ports from kvgate.localports.
"""
