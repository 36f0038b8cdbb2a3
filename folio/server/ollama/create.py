"""Ollama's /api/create, /api/copy and /api/blobs: models made on the server from the ones it serves.

`ollama create NAME -f Modelfile` reads the Modelfile itself and sends its lines as fields: FROM as
`from`, ADAPTER's files as `adapters` (uploaded first to /api/blobs/<digest>), PARAMETER lines as
`parameters`, and TEMPLATE, SYSTEM, LICENSE and MESSAGE as theirs. A created model keeps its base's
weights where they are (server/created_models.py); its adapter's files are copied out of the blobs.
Templates are Jinja, as a Hugging Face chat template (Ollama's own Go templates are refused: folio
does not render them).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import jinja2.sandbox
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ConfigDict, Field, ValidationError

from folio.lora.adapter import CONFIG, WEIGHTS
from folio.server.body_route import OffLoopBodyRoute
from folio.server.created_models import ModelPreset
from folio.server.errors import APIError
from folio.server.ollama.chat import NDJSON
from folio.server.ollama.protocol import OllamaMessage, OllamaOptions
from folio.server.request_body import RequestBody
from folio.server.served_models import ServedModels

DIGEST = re.compile(r"sha256[:-]([0-9a-f]{64})")
BLOB_LIMIT = 64 * 2**30  # bytes one uploaded file may have
GO_TEMPLATE = re.compile(r"\{\{-?\s*\.")  # `{{ .Prompt }}`: Ollama's Go template syntax


class OllamaCreateRequest(RequestBody):
    model_config = ConfigDict(populate_by_name=True)
    model: str | None = None
    name: str | None = None  # older clients send "name"
    from_: str | None = Field(None, alias="from")
    files: dict[str, str] | None = None
    adapters: dict[str, str] | None = None
    template: str | None = None
    license: str | list[str] | None = None
    system: str | None = None
    parameters: dict[str, Any] | None = None
    messages: list[OllamaMessage] | None = None
    stream: bool = True
    quantize: str | None = None
    modelfile: str | None = None  # the API before Ollama 0.5: a Modelfile's text, parsed by the server


class OllamaCopyRequest(RequestBody):
    source: str = Field(min_length=1)
    destination: str = Field(min_length=1)


class BlobStore:
    """Uploaded files by their sha256 digest, as Ollama keeps them (each written whole, then renamed)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, digest: str) -> Path:
        match = DIGEST.fullmatch(digest)
        if match is None:
            raise APIError(400, f"'{digest}' is not a blob digest (sha256:<64 hex digits>)", param="digest")
        return self.root / f"sha256-{match.group(1)}"

    async def receive(self, digest: str, request: Request) -> None:
        target = self.path(digest)
        if target.exists():
            return
        self.root.mkdir(parents=True, exist_ok=True)
        fd, staged = tempfile.mkstemp(dir=self.root, prefix=".upload-")
        hasher, size = hashlib.sha256(), 0
        try:
            with os.fdopen(fd, "wb") as out:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > BLOB_LIMIT:
                        raise APIError(413, f"a blob may have at most {BLOB_LIMIT} bytes")
                    hasher.update(chunk)
                    out.write(chunk)
            if f"sha256-{hasher.hexdigest()}" != target.name:
                raise APIError(400, f"the uploaded bytes' digest is sha256:{hasher.hexdigest()}, not {digest}",
                               param="digest")  # fmt: skip
            os.replace(staged, target)
        finally:
            Path(staged).unlink(missing_ok=True)


def _preset(body: OllamaCreateRequest) -> ModelPreset:
    """The request's settings, each checked as a request would be."""
    parameters = {name: value for name, value in (body.parameters or {}).items() if value is not None}
    try:
        OllamaOptions(**parameters).check_extras()
    except ValidationError as exc:
        first = exc.errors()[0]
        raise APIError(400, f"parameter {'.'.join(map(str, first['loc']))}: {first['msg']}",
                       param="parameters") from None  # fmt: skip
    except APIError as exc:
        raise APIError(400, exc.message, param="parameters") from None
    template = body.template
    if template is not None:
        if GO_TEMPLATE.search(template):
            raise APIError(400, "this is one of Ollama's Go templates: folio renders chat templates in Jinja, as a "
                           "Hugging Face tokenizer_config.json's chat_template", param="template")  # fmt: skip
        try:
            jinja2.sandbox.ImmutableSandboxedEnvironment().parse(template)
        except jinja2.TemplateSyntaxError as exc:
            raise APIError(400, f"the template is not valid Jinja: {exc}", param="template") from None
    license_text = "\n".join(body.license) if isinstance(body.license, list) else body.license
    messages = tuple({"role": m.role, "content": m.content} for m in body.messages or ())
    return ModelPreset(body.system, template, parameters, messages, license_text)


def _adapter_files(adapters: dict[str, str] | None, blobs: BlobStore) -> dict[str, Path] | None:
    if not adapters:
        return None
    files = {}
    for filename, digest in adapters.items():
        name = Path(filename).name
        if name.endswith(".gguf"):
            raise APIError(400, "GGUF LoRA adapters are not read: give the PEFT adapter's adapter_config.json and "
                           "adapter_model.safetensors", param="adapters")  # fmt: skip
        path = blobs.path(digest)
        if not path.is_file():
            raise APIError(400, f"blob {digest} was not uploaded (POST /api/blobs/{digest} first)", param="adapters")
        if name in (CONFIG, WEIGHTS):
            files[name] = path
    return files


def ollama_create_router(models: ServedModels, blobs: BlobStore) -> APIRouter:
    """The routes; an upload's body is streamed to disk (BodySizeLimit leaves /api/blobs/ to BLOB_LIMIT)."""
    router = APIRouter(prefix="/api", route_class=OffLoopBodyRoute)

    @router.head("/blobs/{digest}")
    async def has_blob(digest: str) -> Response:
        return Response(status_code=200 if blobs.path(digest).is_file() else 404)

    @router.post("/blobs/{digest}")
    async def upload_blob(digest: str, request: Request) -> Response:
        if not models.loads_on_demand:
            raise APIError(400, "blobs are for /api/create: serve several models (or none: every pulled one)")
        await blobs.receive(digest, request)
        return Response(status_code=201)

    @router.post("/create")
    async def create(body: OllamaCreateRequest):
        name = body.model or body.name
        if not name:
            raise APIError(400, "model is required", param="model")
        if body.modelfile is not None:
            raise APIError(400, "send the Modelfile's lines as fields (from, adapters, parameters, template, system), "
                           "as `ollama create` does", param="modelfile")  # fmt: skip
        if body.quantize is not None:
            raise APIError(400, "quantizing on create is not supported: `folio quantize` writes quantized files",
                           param="quantize")  # fmt: skip
        if body.files:
            raise APIError(400, "creating a model from weight files is not supported: put the .gguf file in the "
                           "--models-dir folder", param="files")  # fmt: skip
        if not body.from_:
            raise APIError(400, "from is required: the model this one is made from", param="from")
        await models.create(name, body.from_, _preset(body), _adapter_files(body.adapters, blobs))
        steps = [{"status": "using the base model's weights"}, {"status": "writing manifest"}, {"status": "success"}]
        if body.stream:
            return StreamingResponse(iter(json.dumps(step) + "\n" for step in steps), media_type=NDJSON)
        return steps[-1]

    @router.post("/copy")
    async def copy(body: OllamaCopyRequest) -> Response:
        await models.create(body.destination, body.source, ModelPreset())
        return Response(status_code=200)

    return router
