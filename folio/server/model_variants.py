"""The names a server of several models answers to beyond its models' own: LoRA adapters (adapters.py)
and created models (created_models.py), each running on a served base model. A request for one gets the
base's context with the adapter set and the preset applied (its chat template in place of the model's).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

from folio.loaders.tokenizer import Tokenizer
from folio.lora.adapter import CONFIG, WEIGHTS, read_adapter_config
from folio.server.adapters import AdapterTable, LoRAModule
from folio.server.context import ServerContext
from folio.server.created_models import CreatedModel, CreatedModels, ModelPreset, check_name
from folio.server.errors import APIError
from folio.server.model_budget import LoadedModel
from folio.server.model_sources import LATEST, ModelSources
from folio.server.served_models import ModelStatus, add_adapter, remove_adapter

logger = logging.getLogger("folio")

Loaded = Callable[[str], LoadedModel | None]  # the manager's loaded model of a name, if any
BASE_FORM = '{"name": ..., "path": ..., "base_model_name": ...}'  # vLLM's JSON form of a --lora-modules entry


class Variants:
    def __init__(self, sources: ModelSources, adapters: AdapterTable, created: CreatedModels) -> None:
        self.sources, self.adapters, self.created = sources, adapters, created
        for adapter in adapters:
            if adapter.base_model_name is None:
                raise ValueError(f"--lora-modules {adapter.name}=PATH serves an adapter beside one model; among "
                                 f"several, name its base: '{BASE_FORM}'")  # fmt: skip
            base = sources.find(adapter.base_model_name)
            if base is None:
                raise ValueError(f"the LoRA adapter {adapter.name!r} names {adapter.base_model_name!r} as its base "
                                 "model, which this server does not serve")  # fmt: skip
            adapters.add(replace(adapter, base_model_name=base.name))
            if sources.find(adapter.name) is not None:
                raise ValueError(f"the LoRA adapter {adapter.name!r} has a served model's name")
            read_adapter_config(adapter.path)  # a wrong folder fails at start, not at the base model's load
        for model in created:
            if sources.find(model.base) is None or sources.find(model.name) is not None:
                logger.warning("not serving the created model %s: its base %s is not served here, or a model has "
                               "its name", model.name, model.base)  # fmt: skip
                self.created.forget(model.name)
            elif model.adapter is not None:
                adapters.add(LoRAModule(model.name, model.adapter, model.base))
        # Per created model with a template: its base's tokenizer (held, so that it is the same one while
        # the base stays loaded) and that tokenizer with the template.
        self._tokenizers: dict[str, tuple[Tokenizer, Tokenizer]] = {}

    def created_model(self, name: str | None) -> CreatedModel | None:
        return self.created.get(name) or self.created.get(name.removesuffix(LATEST)) if name else None

    def base_of(self, name: str | None) -> str | None:
        """The served model a name runs on: a created model's or an adapter's base, or the name itself."""
        created = self.created_model(name)
        if created is not None:
            return created.base
        adapter = self.adapters.get(name)
        return adapter.base_model_name if adapter is not None else name

    def context(self, name: str | None, base: ServerContext) -> ServerContext:
        """The context a request for `name` runs in, from its base model's."""
        adapter, created = self.adapters.get(name), self.created_model(name)
        context = base
        if adapter is not None:
            context = replace(context, model_name=adapter.name, lora_name=adapter.name)
        if created is not None:
            tokenizer = context.tokenizer
            template = created.preset.template
            if template is not None:
                kept = self._tokenizers.get(created.name)
                if kept is None or kept[0] is not tokenizer or kept[1].chat_template != template:
                    kept = self._tokenizers[created.name] = (tokenizer, replace(tokenizer, chat_template=template))
                tokenizer = kept[1]
            context = replace(context, model_name=created.name, preset=created.preset, tokenizer=tokenizer)
        return context

    def statuses(self, models: list[ModelStatus]) -> list[ModelStatus]:
        """The models' statuses, then each adapter's and created model's (its base's state)."""
        states = {status.name: status.state for status in models}
        listed = list(models)
        for adapter in self.adapters:
            if self.created.get(adapter.name) is None:
                base = adapter.base_model_name or ""
                listed.append(ModelStatus(adapter.name, states.get(base, "unloaded"), "adapter", parent=base))
        for created in self.created:
            listed.append(ModelStatus(created.name, states.get(created.base, "unloaded"), "created",
                                      parent=created.base))  # fmt: skip
        return listed

    def plan(
        self, name: str, source: str, preset: ModelPreset, adapter_files: dict[str, Path] | None
    ) -> tuple[CreatedModel, dict[str, Path] | None]:
        """The created model `name` made from `source` (a model, an adapter or a created model, flattened
        onto its served base: presets merged, the adapter's files carried over), and the adapter files
        to copy in; APIError naming what is wrong. The adapter itself is checked once its files are in
        place (`check_adapter`)."""
        try:
            check_name(name)
        except ValueError as exc:
            raise APIError(400, str(exc), param="model") from None
        if self.sources.find(name) is not None or (name in {a.name for a in self.adapters}
                                                   and self.created.get(name) is None):  # fmt: skip
            raise APIError(400, f"'{name}' is a served model's or adapter's name", param="model")
        created, adapter = self.created_model(source), self.adapters.get(source)
        base = self.base_of(source)
        found = self.sources.find(base) if base else None
        if found is None:
            raise APIError(404, f"model '{source}' not found", param="from")
        if created is not None:
            preset = preset.merged_over(created.preset)
        if adapter_files is None and adapter is not None:  # the source's adapter comes along
            folder = Path(adapter.path).expanduser()
            adapter_files = {CONFIG: folder / CONFIG, WEIGHTS: folder / WEIGHTS}
        if adapter_files is not None and {CONFIG, WEIGHTS} - set(adapter_files):
            raise APIError(400, f"a LoRA adapter is PEFT's {CONFIG} and {WEIGHTS} (GGUF adapters are not read)",
                           param="adapters")  # fmt: skip
        return CreatedModel(name, found.name, preset), adapter_files

    def check_adapter(self, model: CreatedModel) -> None:
        """A saved created model's adapter, read as PEFT's: a 400 (and the model gone) if it is not one."""
        if model.adapter is None:
            return
        try:
            read_adapter_config(model.adapter)
        except ValueError as exc:
            self.created.remove(model.name)
            raise APIError(400, str(exc), param="adapters") from None

    # -- changes (the manager's, which passes what it has loaded) ----------------------------------------
    def check_new_adapter(self, name: str, base: str | None) -> None:
        self.adapters.require_runtime()
        if self.sources.find(name) is not None or self.created_model(name) is not None:
            raise APIError(400, f"'{name}' is a model's name", param="lora_name")
        if base is None:
            raise APIError(400, "this server serves several models: name the adapter's base model "
                           "(base_model_name)", param="base_model_name")  # fmt: skip

    async def register(self, model: LoadedModel, adapter: LoRAModule) -> None:
        """Into the loaded base's engine first (a 400 if it cannot serve it), then listed."""
        await add_adapter(model.engine, adapter)
        self.adapters.add(adapter)

    async def unregister(self, name: str, loaded: Loaded) -> None:
        self.adapters.require_runtime()
        adapter = self.adapters.known(name)
        if self.created_model(name) is not None:
            raise APIError(400, f"'{name}' is a created model: delete it (/api/delete)", param="lora_name")
        model = loaded(adapter.base_model_name or "")
        if model is not None and model.engine.is_alive:
            await remove_adapter(model.engine, adapter.name)
        self.adapters.remove(adapter.name)

    async def create(
        self, name: str, source: str, preset: ModelPreset, adapter_files: dict[str, Path] | None, loaded: Loaded,
        unload: Callable[[str], Awaitable[bool]],
    ) -> None:  # fmt: skip
        """Make (or remake) a created model, its adapter registered in its base's engine if that is loaded
        with LoRA slots; a base loaded without them is unloaded, to load with them when next asked for."""
        model, adapter_files = self.plan(name, source, preset, adapter_files)
        old = self.created_model(name)
        if old is not None:
            await self.drop_created(old, loaded)
        saved = await asyncio.to_thread(self.created.save, model, adapter_files)
        self.check_adapter(saved)
        if saved.adapter is None:
            return
        adapter = LoRAModule(saved.name, saved.adapter, saved.base)
        self.adapters.add(adapter)
        base = loaded(saved.base)
        if base is not None and base.lora:
            await add_adapter(base.engine, adapter)
        elif base is not None:
            await unload(saved.base)

    async def drop_created(self, created: CreatedModel, loaded: Loaded) -> None:
        if created.adapter is not None:
            base = loaded(created.base)
            if base is not None and base.engine.is_alive and base.lora:
                await remove_adapter(base.engine, created.name)
            self.adapters.remove(created.name)
        await asyncio.to_thread(self.created.remove, created.name)
