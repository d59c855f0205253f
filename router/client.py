"""A small command-line client of the external API, for trying a server by hand.

    python -m router.client generate "def hello():" --max-new-tokens 20 [--stream] [--sample --seed 7]
    python -m router.client tokenize "Hello there"
    python -m router.client model-info

Any TGIS client works the same way: the API is fmaas.GenerationService (proto/generation.proto).
"""

from __future__ import annotations

import click
import grpc
from google.protobuf import json_format

from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc


def _stub(address: str) -> generation_pb2_grpc.GenerationServiceStub:
    return generation_pb2_grpc.GenerationServiceStub(grpc.insecure_channel(address))


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--address", default="localhost:8033", envvar="GRPC_ADDRESS", help="Server host:port.")
@click.pass_context
def main(ctx: click.Context, address: str) -> None:
    """Call a running text-generation server."""
    ctx.obj = _stub(address)


@main.command()
@click.argument("texts", nargs=-1, required=True)
@click.option("--max-new-tokens", type=int, default=20)
@click.option("--min-new-tokens", type=int, default=0)
@click.option("--stop", "stop_sequences", multiple=True, help="A stop sequence (repeatable).")
@click.option("--sample", is_flag=True, help="Sample instead of greedy decoding.")
@click.option("--temperature", type=float, default=None)
@click.option("--top-k", type=int, default=0)
@click.option("--top-p", type=float, default=0.0)
@click.option("--seed", type=int, default=None)
@click.option("--stream", is_flag=True, help="Use GenerateStream (one text only).")
@click.option("--json", "as_json", is_flag=True, help="Print the responses as protobuf JSON.")
@click.pass_obj
def generate(
    stub: generation_pb2_grpc.GenerationServiceStub,
    texts: tuple[str, ...],
    max_new_tokens: int,
    min_new_tokens: int,
    stop_sequences: tuple[str, ...],
    sample: bool,
    temperature: float | None,
    top_k: int,
    top_p: float,
    seed: int | None,
    stream: bool,
    as_json: bool,
) -> None:
    """Generate text for TEXTS."""
    params = pb.Parameters(
        method=pb.SAMPLE if sample else pb.GREEDY,
        stopping=pb.StoppingCriteria(
            max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, stop_sequences=stop_sequences
        ),
    )
    if sample:
        params.sampling.top_k, params.sampling.top_p = top_k, top_p
        if temperature is not None:
            params.sampling.temperature = temperature
        if seed is not None:
            params.sampling.seed = seed
    try:
        if stream:
            if len(texts) != 1:
                raise click.UsageError("--stream takes exactly one text")
            request = pb.SingleGenerationRequest(request=pb.GenerationRequest(text=texts[0]), params=params)
            for message in stub.GenerateStream(request):
                if as_json:
                    click.echo(json_format.MessageToJson(message, indent=None))
                else:
                    click.echo(message.text, nl=False)
            if not as_json:
                click.echo()
            return
        requests = [pb.GenerationRequest(text=t) for t in texts]
        reply = stub.Generate(pb.BatchedGenerationRequest(requests=requests, params=params))
    except grpc.RpcError as error:
        raise click.ClickException(f"{error.code().name}: {error.details()}") from error
    for response in reply.responses:
        if as_json:
            click.echo(json_format.MessageToJson(response, indent=None))
        else:
            reason = pb.StopReason.Name(response.stop_reason)
            click.echo(f"{response.text}\n[{response.generated_token_count} tokens, {reason}]")


@main.command()
@click.argument("texts", nargs=-1, required=True)
@click.pass_obj
def tokenize(stub: generation_pb2_grpc.GenerationServiceStub, texts: tuple[str, ...]) -> None:
    """Show the tokens of TEXTS."""
    request = pb.BatchedTokenizeRequest(
        requests=[pb.TokenizeRequest(text=t) for t in texts], return_tokens=True, return_offsets=True
    )
    reply = stub.Tokenize(request)
    click.echo(json_format.MessageToJson(reply, indent=2))


@main.command("model-info")
@click.pass_obj
def model_info(stub: generation_pb2_grpc.GenerationServiceStub) -> None:
    """Show the model kind and the server's limits."""
    click.echo(json_format.MessageToJson(stub.ModelInfo(pb.ModelInfoRequest()), indent=2))


if __name__ == "__main__":
    main()
