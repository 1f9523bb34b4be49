"""`kvgate demo`: the whole stack on one machine (real Envoy, gate, agents, simulated GPU nodes),
replaying a scenario through a plain Envoy and through kvgate, side by side."""
