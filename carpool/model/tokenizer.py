"""Tokenizer and chat template, on the `tokenizers` library alone.

transformers is not needed at run time: `Tokenizer.from_dir` reads the files a
HF model directory carries (tokenizer.json, tokenizer_config.json, and
generation_config.json when present) and renders chat templates with a
sandboxed jinja2 environment configured the way transformers configures its
own, so prompts come out byte-identical.
"""

from __future__ import annotations

import copy
import json
import secrets
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The chat template is missing, malformed, or raised while rendering."""


class Tokenizer:
    """A fast tokenizer plus the special-token facts and chat template a model needs.

    ``encode``/``decode`` go straight to `tokenizers.Tokenizer`; special tokens
    written in the text (``<|im_start|>``) are always matched whole, whatever
    ``add_special_tokens`` says (that flag only controls the BOS/EOS the
    post-processor adds). ``decode`` of an incomplete UTF-8 sequence yields
    U+FFFD; the incremental detokenizer is what holds such text back.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Sequence[int] = (),
        template_tokens: dict[str, str] | None = None,
    ) -> None:
        self._backend = backend
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        ids = list(dict.fromkeys(int(i) for i in eos_token_ids))
        eos_id = backend.token_to_id(eos_token) if eos_token else None
        if eos_id is not None and eos_id not in ids:
            ids.append(eos_id)
        self._eos_token_ids = ids
        added = backend.get_added_tokens_decoder()
        self._special_ids = sorted(i for i, tok in added.items() if tok.special)
        self._special_texts = [added[i].content for i in self._special_ids]
        self._plain_backend: tokenizers.Tokenizer | None = None
        self._template_tokens = {"bos_token": bos_token or "", "eos_token": eos_token or ""}
        self._template_tokens.update(template_tokens or {})
        self.chat_template = chat_template
        self._compiled = compile_chat_template(chat_template) if chat_template else None

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load from a HF-style directory; raises OSError/ValueError on bad files."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file} not found (only fast tokenizers are supported)")
        backend = tokenizers.Tokenizer.from_file(str(tok_file))
        config = _read_json(path / "tokenizer_config.json") or {}
        generation = _read_json(path / "generation_config.json") or {}
        return cls.from_parts(backend, config, generation, _chat_template_of(path, config))

    @classmethod
    def from_parts(cls, backend: tokenizers.Tokenizer, config: dict, generation: dict | None = None,
                   chat_template: str | None = None) -> "Tokenizer":
        """From what a model directory's files hold: the tokenizer.json model
        (``backend``), tokenizer_config.json (``config``) and
        generation_config.json (``generation``); ``chat_template`` (default:
        the config's own, when it is a single template)."""
        specials = {
            name: _token_text(config.get(name))
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        eos_ids = (generation or {}).get("eos_token_id")
        eos_ids = eos_ids if isinstance(eos_ids, list) else ([] if eos_ids is None else [eos_ids])
        if chat_template is None and isinstance(config.get("chat_template"), str):
            chat_template = config["chat_template"]
        return cls(
            backend,
            chat_template=chat_template,
            bos_token=specials["bos_token"],
            eos_token=specials["eos_token"],
            eos_token_ids=eos_ids,
            template_tokens={k: v for k, v in specials.items() if v is not None},
        )

    def describe(self) -> dict[str, Any]:
        """Everything this tokenizer is made of, as plain data (JSON/msgpack):
        ``from_description`` rebuilds an equal one in another process."""
        return {"backend": self._backend.to_str(), "chat_template": self.chat_template,
                "bos_token": self._bos_token, "eos_token": self._eos_token,
                "eos_token_ids": list(self._eos_token_ids),
                "template_tokens": dict(self._template_tokens)}

    @classmethod
    def from_description(cls, description: dict[str, Any]) -> "Tokenizer":
        """The tokenizer ``describe`` described."""
        return cls(tokenizers.Tokenizer.from_str(description["backend"]),
                   chat_template=description["chat_template"],
                   bos_token=description["bos_token"], eos_token=description["eos_token"],
                   eos_token_ids=description["eos_token_ids"],
                   template_tokens=description["template_tokens"])

    def with_chat_template(self, template: str) -> "Tokenizer":
        """This tokenizer with ``template`` as its chat template (vLLM's
        ``--chat-template``); ChatTemplateError when it does not compile."""
        compiled = compile_chat_template(template)
        other = copy.copy(self)
        other.chat_template, other._compiled = template, compiled
        return other

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds the model's BOS/EOS framing."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; a partial UTF-8 sequence decodes to U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of ``token_id`` (byte-level spelling), or None."""
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of the vocabulary string ``token``, or None."""
        return self._backend.token_to_id(token)

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` with the model's chat template.

        Extra keyword arguments (``tools``, ``documents``, ...) become template
        variables, as in transformers. Raises ChatTemplateError when there is no
        template or the template fails (including its own ``raise_exception``).
        """
        if self._compiled is None:
            raise ChatTemplateError("this model has no chat template")
        variables = dict(self._template_tokens)
        variables.update(kwargs)
        try:
            return self._compiled.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    special_tokens_in_content: bool = False, **variables: Any) -> list[int]:
        """Token ids of ``messages`` rendered with the chat template.

        By default a special token's text inside a message's content (say
        ``<|im_start|>system``) is tokenized as plain text, so user content
        cannot forge chat-control tokens; ``special_tokens_in_content``
        restores the raw behaviour (the rendered text tokenized as a whole).
        Content without such text is tokenized exactly as the whole text.
        ``variables`` (``tools``, ...) go to the template as they are.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, **variables)
        contents = [str(m.get("content") or "") for m in messages]
        if special_tokens_in_content or not any(self._has_special_text(c) for c in contents):
            return self.encode(text)
        # Render again with each content replaced by a unique marker: what lies
        # between markers is the template's own text (special tokens parsed);
        # the contents are tokenized with special-token parsing off.
        nonce = secrets.token_hex(8)
        markers = [f"\x00{nonce}:{i}\x00" for i in range(len(messages))]
        marked = [{**m, "content": marker} for m, marker in zip(messages, markers)]
        rendered = self.apply_chat_template(marked, add_generation_prompt, **variables)
        ids: list[int] = []
        for marker, content in zip(markers, contents):
            head, found, rendered = rendered.partition(marker)
            if not found:
                raise ChatTemplateError("message content contains special-token text that this "
                                        "chat template cannot keep apart from its own tokens")
            ids += self.encode(head) + self._plain().encode(content, add_special_tokens=False).ids
        return ids + self.encode(rendered)

    def _has_special_text(self, content: str) -> bool:
        return any(token in content for token in self._special_texts)

    def _plain(self) -> tokenizers.Tokenizer:
        """A copy of the backend that reads special-token text as plain text."""
        if self._plain_backend is None:
            plain = tokenizers.Tokenizer.from_str(self._backend.to_str())
            plain.encode_special_tokens = True
            self._plain_backend = plain
        return self._plain_backend

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end generation: generation_config's list, then the eos token."""
        return list(self._eos_token_ids)

    @property
    def bos_token_id(self) -> int | None:
        """Id of the BOS token, or None when the model has none."""
        return self._bos_token_id

    @property
    def bos_token(self) -> str | None:
        """Text of the BOS token, or None."""
        return self._bos_token

    @property
    def eos_token(self) -> str | None:
        """Text of the EOS token, or None."""
        return self._eos_token

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of every added token marked special (skipped by ``decode``)."""
        return list(self._special_ids)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._backend


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template_of(path: Path, config: dict) -> str | None:
    """The default template: tokenizer_config.json, else chat_template.jinja/.json."""
    template = config.get("chat_template")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None:
        template = (_read_json(path / "chat_template.json") or {}).get("chat_template")
    if isinstance(template, list):
        # Several named templates: the one named "default" is the chat template.
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class _GenerationTag(jinja2.ext.Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` and renders the body as is.

    transformers uses the tag to mark assistant tokens for training masks;
    templates that contain it must still render here.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson HTML-escapes <, >, & and '; transformers' does not.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def read_chat_template(value: str) -> str:
    """A ``--chat-template`` value as vLLM reads it: the text of the file it
    names, else the template text itself. A value that names no file and
    holds no template syntax (``{``, ``}`` or a line break) is a missing
    file: ChatTemplateError."""
    try:
        path = Path(value).expanduser()
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:  # template text too long for a file name
        pass
    if not any(mark in value for mark in "{}\n"):
        raise ChatTemplateError("no such file, and no template text either (no { or } in it)")
    return value


def compile_chat_template(source: str) -> jinja2.Template:
    """``source`` compiled as transformers compiles chat templates;
    ChatTemplateError (one line) when it does not compile."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        where = f" (line {exc.lineno})" if exc.lineno else ""
        raise ChatTemplateError(f"chat template does not compile{where}: {exc.message or exc}") from exc
