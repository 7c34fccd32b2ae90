"""Chat turns as the model's template renders them, and what is new since the last reply.

A conversation continues on one generator: each turn renders the whole conversation with the chat
template (jinja2, as Hugging Face's templates are written) and only what the rendering adds to the
text already fed is new. Templates may render the last reply otherwise than it was generated
(trimmed, say), or rewrite earlier turns; `Conversation.add` says from where to feed again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edge_sd.errors import UsageError
from edge_sd.manifest import EngineManifest


def template_note(m: EngineManifest) -> str | None:
    """What a user should hear before chatting with an engine whose source carried no chat template:
    the built-in format export chose from the vocabulary renders the turns, but a model without one of
    its own is often a pretrained one, which continues the text instead of answering it."""
    origin = m.exporter.get("chat_template", "")
    if not origin.startswith("built-in"):
        return None
    return (f"{m.name}'s source has no chat template; its turns use the {origin.split(' (')[0]} format. "
            "A model not tuned for chat (a pretrained one) continues such text rather than answering it")


def render_chat(m: EngineManifest, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """Apply the engine's chat template."""
    if not m.chat_template:
        raise UsageError(f"{m.name} has no chat template; drop --chat")
    try:
        import jinja2
    except ImportError:
        raise UsageError("chat templates need jinja2: pip install '.[chat]' in a clone of edge-sd") from None
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(msg: str) -> None:
        raise UsageError(f"chat template: {msg}")

    env.globals["raise_exception"] = raise_exception
    specials = {"bos_token": "", "eos_token": ""}
    return env.from_string(m.chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                   **specials)


@dataclass
class Turn:
    """What a new turn feeds: `refeed_from` (None: nothing) is where the sequence must be cut back to
    because the template rendered what came before otherwise; `new` is the target's new text;
    `drafter_text` the drafter's whole rendering where it has a template of its own (None: it reads
    the target's text)."""

    refeed_from: int | None
    new: str
    drafter_text: str | None
    rendered: str


@dataclass
class Conversation:
    """The turns so far, the target's rendering the sequence is made of, and where the last reply
    started (its ids before it, and the rendering up to it)."""

    messages: list[dict[str, str]] = field(default_factory=list)
    rendered: str = ""
    base: tuple[int, str] = (0, "")

    @property
    def started(self) -> bool:
        return bool(self.messages)

    def copy(self) -> Conversation:
        return Conversation([dict(m) for m in self.messages], self.rendered, self.base)

    def add(self, messages: list[dict[str, str]], target: EngineManifest, drafter: EngineManifest | None) -> Turn:
        """Add turns (each a role and its content) and render the conversation up to the reply to them."""
        self.messages += [{"role": m["role"], "content": m["content"]} for m in messages]
        full = render_chat(target, self.messages)
        before, refeed = self.rendered, None
        if not full.startswith(before):
            # The template renders the last reply otherwise than it was generated: that reply is fed
            # again as the template has it; a template that rewrote an earlier turn has the whole
            # conversation fed again.
            refeed, before = self.base if full.startswith(self.base[1]) else (0, "")
        d_full = render_chat(drafter, self.messages) if drafter is not None and drafter.chat_template else None
        self.rendered = full
        return Turn(refeed, full[len(before):], d_full, full)

    def replied(self, reply_text: str, generated: str) -> None:
        """The reply ended: its text joins the rendering (as generated) and the turns (as shown)."""
        self.rendered += generated
        self.messages.append({"role": "assistant", "content": reply_text})
