"""A small KVServe gRPC client: prints the generated text as it arrives.

    python -m api.grpc_client_example --address localhost:9000 --prompt "Hello" [--stream] [--max-tokens N]
        [--json-schema '{"type": "object", ...}' | --json-object | --regex RE | --choice A --choice B | --grammar G]

Behind Ray Serve's gRPC proxy, ``--app NAME`` sends the ``application`` metadata the proxy uses to
pick the application (needed when more than one is running); ``--api-key KEY`` (default: the
``KVSERVE_API_KEY`` environment variable) sends ``authorization: Bearer KEY``. The text goes to stdout; the finish
reason and the token usage go to stderr; a failed call prints its status code and details to stderr
and exits with status 1.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from api import kvserve_pb2 as pb
from api import kvserve_pb2_grpc


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--address", default="localhost:9000", help="host:port of the gRPC server")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--stream", action="store_true", help="use GenerateStream and print deltas")
    parser.add_argument("--max-tokens", type=int, default=None, help="default: the server's (16)")
    parser.add_argument("--temperature", type=float, default=None, help="0 is greedy; default 1")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--app", default=None, help="Ray Serve application name (`application` metadata)")
    parser.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"),
                        help="the server's API key (default: $KVSERVE_API_KEY)")
    parser.add_argument("--request-id", default="", help="default: the server makes one")
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", default=None, help="constrain the output to this JSON schema (its text)")
    constraint.add_argument("--json-object", action="store_true", help="constrain the output to a JSON object")
    constraint.add_argument("--regex", default=None, help="constrain the output to match this regular expression")
    constraint.add_argument("--choice", action="append", default=None, help="a choice the output must be (repeat)")
    constraint.add_argument("--grammar", default=None, help="constrain the output to this EBNF grammar (rule root)")
    parser.add_argument("--timeout", type=float, default=60.0, help="deadline of the call, seconds")
    return parser.parse_args(argv)


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    params = pb.SamplingParameters()
    if args.max_tokens is not None:
        params.max_tokens = args.max_tokens
    if args.temperature is not None:
        params.temperature = args.temperature
    if args.seed is not None:
        params.seed = args.seed
    if args.json_schema is not None:
        params.json_schema = args.json_schema
    elif args.json_object:
        params.json_object = True
    elif args.regex is not None:
        params.regex = args.regex
    elif args.choice:
        params.choice.choices.extend(args.choice)
    elif args.grammar is not None:
        params.grammar = args.grammar
    return pb.GenerateRequest(text=args.prompt, params=params, request_id=args.request_id)


def _report(completion: pb.Completion, usage: pb.Usage, request_id: str) -> None:
    print(f"[{request_id}] finish_reason={completion.finish_reason or '-'} "
          f"prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens} "
          f"cached_tokens={usage.cached_tokens}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Send one request; 0 on success, 1 on an RPC error."""
    metadata = [("application", args.app)] if args.app else []
    if args.api_key:
        metadata.append(("authorization", f"Bearer {args.api_key}"))
    metadata = metadata or None
    request = build_request(args)
    with grpc.insecure_channel(args.address) as channel:
        stub = kvserve_pb2_grpc.KVServeStub(channel)
        try:
            if args.stream:
                last = pb.Completion()
                for message in stub.GenerateStream(request, metadata=metadata, timeout=args.timeout):
                    for completion in message.completions:
                        print(completion.text, end="", flush=True)
                        last = completion
                    if message.HasField("usage"):
                        print()
                        _report(last, message.usage, message.request_id)
            else:
                response = stub.Generate(request, metadata=metadata, timeout=args.timeout)
                for completion in response.completions:
                    print(completion.text, flush=True)
                if response.completions:
                    _report(response.completions[-1], response.usage, response.request_id)
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
