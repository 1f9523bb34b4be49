"""What the agent reads: its engine's /metrics page and the GPUs.

Pure (no I/O):
    engines         read_engine_page(text) -> EngineReading: vLLM, SGLang, TGI, llama.cpp readers
Adapters:
    scrape, fake_engine         the engine's /metrics over kept-alive HTTP/1.1; a fake /metrics to test
    nvml, fake_nvml             GPU sampling through nvidia-ml-py on its own thread; a scriptable fake
    kv_events                   the engine's KV events over ZeroMQ, on their own thread
"""
