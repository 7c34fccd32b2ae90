"""The one-call API: load a folder, generate or stream the reply to a prompt.

Pipeline is a Model (model.py) with `generate`, `stream` and `stream_events`, each a fresh Generator
(generator.py) per call: calls may run in several threads at once, each on caches of its own. Apps
that continue a conversation, feed token ids or step through rounds use Model and Generator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from collections.abc import Generator as PyGenerator

from edge_sd.algorithms.base import Proposer
from edge_sd.chat import render_chat
from edge_sd.config import GenerationConfig, GenerationResult
from edge_sd.costs import Costs
from edge_sd.decoder import Emitted
from edge_sd.generator import Generator
from edge_sd.model import Model
from edge_sd.schedules import Schedule
from edge_sd.schedules.choose import DEFAULT_LOOKAHEAD, DEFAULT_MAX_LOOKAHEAD

__all__ = ["DEFAULT_LOOKAHEAD", "DEFAULT_MAX_LOOKAHEAD", "Costs", "GenerationConfig", "GenerationResult",
           "Pipeline", "render_chat"]


class Pipeline(Model):
    """A Model with one-call generation.

    Example:
        >>> pipe = Pipeline.from_folder("engines/gemma3-270m_smollm2-135m")
        >>> result = pipe.generate("Once upon a time", GenerationConfig(max_new_tokens=32))
        >>> print(result.text, result.stats.tokens_per_second)
    """

    def stream_events(self, prompt: str, config: GenerationConfig | None = None,
                      make_schedule: Callable[[dict[str, Proposer]], Schedule] | None = None,
                      ) -> PyGenerator[Emitted, None, GenerationResult]:
        """Yield one `Emitted` per round, then return the GenerationResult (generator return value).
        With config.chat the prompt is one user turn, rendered by the chat template."""
        gen = Generator(self, config, make_schedule)
        if gen.config.chat:
            gen.append_chat(prompt)
        else:
            gen.append_text(prompt)
        while not gen.is_done:
            event = gen.generate_next_tokens()
            if event.ids or event.text:
                yield event
        return gen.result()

    def stream(self, prompt: str, config: GenerationConfig | None = None) -> Iterator[str]:
        """Yield text pieces as they become printable (never half a UTF-8 character)."""
        for event in self.stream_events(prompt, config):
            if event.text:
                yield event.text

    def generate(self, prompt: str, config: GenerationConfig | None = None,
                 make_schedule: Callable[[dict[str, Proposer]], Schedule] | None = None) -> GenerationResult:
        events = self.stream_events(prompt, config, make_schedule)
        while True:
            try:
                next(events)
            except StopIteration as done:
                return done.value
