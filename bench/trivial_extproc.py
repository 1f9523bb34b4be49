"""The floor an ext_proc server in Python costs: grpc.aio on uvloop, parse the body, set the pool.

It answers the same messages as the gate under either shipped Envoy config: with two round trips
(envoy/envoy.yaml) headers continue untouched; the body, the only message with one round trip
(envoy/envoy-one-trip.yaml), is parsed with json.loads and answered with `x-kvgate-pool: interactive`,
the same pool as dynamic metadata (what one-trip routes match) and a cleared route cache. Whatever
the gate costs beyond this server is the gate's own work.

Run: python -m bench.trivial_extproc --listen 127.0.0.1:9102
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
from collections.abc import AsyncIterator

import grpc
import uvloop
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    ProcessingRequest,
    ProcessingResponse,
    StreamedBodyResponse,
)
from google.protobuf.struct_pb2 import Struct

_MESSAGE_LIMIT = 64 * 1024 * 1024
_CONTINUE_HEADERS = ProcessingResponse(request_headers=HeadersResponse())


def answer_body(body: bytes) -> ProcessingResponse:
    """Parse the body (the work every ext_proc router does) and route it to the interactive pool."""
    json.loads(body)
    common, metadata = _routing("x-kvgate-pool", "interactive", ("kvgate", "pool"))
    return ProcessingResponse(request_body=BodyResponse(response=common), dynamic_metadata=metadata)


def _routing(header: str, value: str, key: tuple[str, str]) -> tuple[CommonResponse, Struct]:
    """A header set to `value`, the same value as dynamic metadata at `key`, and the route cache
    cleared: what routes a request."""
    option = HeaderValueOption(
        header=HeaderValue(key=header, raw_value=value.encode()),
        append_action=HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD,
    )
    common = CommonResponse(header_mutation=HeaderMutation(set_headers=[option]), clear_route_cache=True)
    metadata = Struct()
    namespace, name = key
    metadata.fields[namespace].struct_value.fields[name].string_value = value
    return common, metadata


class TrivialProcessor(external_processor_pb2_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    async def Process(
        self, requests: AsyncIterator[ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ProcessingResponse]:
        async for message in requests:
            kind = message.WhichOneof("request")
            if kind == "request_headers":
                yield _CONTINUE_HEADERS
            elif kind == "request_body":
                yield answer_body(message.request_body.body)


class TrivialPicker(external_processor_pb2_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """The floor of an endpoint picker in Python (FULL_DUPLEX_STREAMED both ways): hold the body, parse
    it, name one engine in the header and the envoy.lb metadata, hand the body back, and each response
    chunk back as it comes. What kvgate.gate.picker costs beyond it is the picker's own work."""

    async def Process(
        self, requests: AsyncIterator[ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ProcessingResponse]:
        body = bytearray()
        async for message in requests:
            kind = message.WhichOneof("request")
            if kind == "request_body":
                body += message.request_body.body
                if message.request_body.end_of_stream:
                    yield _picked(bytes(body))
                    yield ProcessingResponse(request_body=BodyResponse(response=_streamed(bytes(body), True)))
            elif kind == "response_headers":
                yield ProcessingResponse(response_headers=HeadersResponse())
            elif kind == "response_body":
                chunk = message.response_body
                yield ProcessingResponse(
                    response_body=BodyResponse(response=_streamed(chunk.body, chunk.end_of_stream))
                )


def _picked(body: bytes) -> ProcessingResponse:
    json.loads(body)
    destination = "x-gateway-destination-endpoint"
    common, metadata = _routing(destination, "10.0.0.1:8000", ("envoy.lb", destination))
    return ProcessingResponse(request_headers=HeadersResponse(response=common), dynamic_metadata=metadata)


def _streamed(body: bytes, end_of_stream: bool) -> CommonResponse:
    streamed = StreamedBodyResponse(body=body, end_of_stream=end_of_stream)
    return CommonResponse(body_mutation=BodyMutation(streamed_response=streamed))


async def serve(listen: str) -> None:
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", _MESSAGE_LIMIT),
            ("grpc.max_send_message_length", _MESSAGE_LIMIT),
        ]
    )
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(TrivialProcessor(), server)
    server.add_insecure_port(listen)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop(grace=1)


def main() -> None:
    parser = argparse.ArgumentParser(description="A trivial ext_proc server: the baseline for bench_gate.")
    parser.add_argument("--listen", required=True, help="HOST:PORT to serve on")
    # As the gate does: the floor is a Python ext_proc server at its best. Imported here, so that the
    # servicer alone also runs against a kvgate from before kvgate.allocator (bench instructions).
    from kvgate.allocator import keep_big_buffers

    keep_big_buffers()
    uvloop.run(serve(parser.parse_args().listen))


if __name__ == "__main__":
    main()
