"""A seeded, deterministic multi-user, multi-turn chat trace.

Shape of the trace (every number is a field of `TraceConfig`):

* `num_system_prompts` system prompts; a session picks one with Zipf popularity
  (P(rank k) proportional to 1 / k**zipf_s), so a few prompts are shared by most sessions.
* Sessions arrive as a Poisson process; each has 1 to 12 turns (a geometric length,
  truncated at `max_turns`, mean about 4: most chats are short, a few are long).
* User messages and answers have log-normal lengths, ShareGPT's means (161 input and 338
  output tokens) multiplied by `length_scale` (0.5 by default, so 80 and 169: this CPU
  decodes one request at about 20 tokens/s) and clipped to [min, max].
* Between two turns of a session: the answer's generation time plus a log-normal think time.

Token ids are pseudo-random in [TOKEN_LO, TOKEN_HI) (never special tokens), wrapped in
ChatML-like framing tokens the way SmolLM2's template renders turns, so a prompt is the
session's exact canonical history plus the new user turn, prefix-stable like the real one.
Pure Python: the cache suites replay it with no model. `text_message` turns a length into
natural text for the suites that drive the real model through a tokenizer.
"""

from __future__ import annotations

import bisect
import math
import random
import statistics
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

SHAREGPT_MEAN_INPUT = 161
SHAREGPT_MEAN_OUTPUT = 338
TOKEN_LO, TOKEN_HI = 1000, 49000
# ChatML framing, as SmolLM2's template renders it: <|im_start|>role\n ... <|im_end|>\n
IM_START, IM_END, NEWLINE = 1, 2, 198
ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT = 9690, 4093, 520


@dataclass(frozen=True)
class TraceConfig:
    seed: int = 0
    num_sessions: int = 200
    num_system_prompts: int = 6
    zipf_s: float = 1.1
    system_prompt_tokens: tuple[int, ...] = (300, 220, 160, 420, 120, 260)
    max_turns: int = 12
    mean_turns: float = 4.0
    length_scale: float = 0.5
    input_sigma: float = 0.9
    output_sigma: float = 0.7
    input_clip: tuple[int, int] = (4, 512)
    output_clip: tuple[int, int] = (8, 512)
    session_rate_per_s: float = 0.2
    mean_think_s: float = 40.0
    decode_tok_per_s: float = 20.0

    @property
    def mean_input(self) -> float:
        return SHAREGPT_MEAN_INPUT * self.length_scale

    @property
    def mean_output(self) -> float:
        return SHAREGPT_MEAN_OUTPUT * self.length_scale


@dataclass(frozen=True)
class Turn:
    at: float  # arrival time of the user message, seconds from the trace's start
    user: tuple[int, ...]  # the tokens this turn appends before generation (framing included)
    answer: tuple[int, ...]  # the generated ids plus the end-of-turn tokens


@dataclass(frozen=True)
class Session:
    index: int
    system: int
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Event:
    at: float
    session: int
    turn: int


@dataclass
class Trace:
    config: TraceConfig
    system_prompts: tuple[tuple[int, ...], ...]
    sessions: tuple[Session, ...]
    _events: list[Event] = field(default_factory=list, repr=False)

    def events(self) -> list[Event]:
        """Every turn of every session in arrival order (ties broken by session, turn)."""
        if not self._events:
            self._events = sorted((Event(t.at, s.index, i) for s in self.sessions for i, t in enumerate(s.turns)),
                                  key=lambda e: (e.at, e.session, e.turn))
        return self._events

    def history(self, session: int, turns: int) -> list[int]:
        """The canonical history after `turns` completed turns (system prompt included)."""
        s = self.sessions[session]
        out = list(self.system_prompts[s.system])
        for turn in s.turns[:turns]:
            out += turn.user
            out += turn.answer
        return out

    def prompt(self, session: int, turn: int) -> list[int]:
        """What turn `turn` of `session` sends to the engine: its history plus the new user turn."""
        return self.history(session, turn) + list(self.sessions[session].turns[turn].user)

    def final_length(self, session: int) -> int:
        return len(self.history(session, len(self.sessions[session].turns)))

    def summary(self) -> dict:
        users = [len(t.user) for s in self.sessions for t in s.turns]
        answers = [len(t.answer) for s in self.sessions for t in s.turns]
        turns = [len(s.turns) for s in self.sessions]
        finals = [self.final_length(s.index) for s in self.sessions]
        popularity = [0] * len(self.system_prompts)
        for s in self.sessions:
            popularity[s.system] += 1
        return {
            "config": asdict(self.config),
            "sessions": len(self.sessions),
            "turns": sum(turns),
            "turns_per_session": {"mean": statistics.fmean(turns), "max": max(turns), "min": min(turns)},
            "user_tokens": _dist(users),
            "answer_tokens": _dist(answers),
            "session_final_tokens": _dist(finals),
            "system_prompt_tokens": [len(p) for p in self.system_prompts],
            "system_prompt_sessions": popularity,
            "duration_s": max(t.at for s in self.sessions for t in s.turns),
        }


def _dist(values: list[int]) -> dict:
    ordered = sorted(values)
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "p90": ordered[int(0.9 * (len(ordered) - 1))],
            "max": ordered[-1], "min": ordered[0]}


def lognormal_length(rng: random.Random, mean: float, sigma: float, clip: tuple[int, int]) -> int:
    """A log-normal draw with the given mean (mu = ln(mean) - sigma^2 / 2), rounded and clipped."""
    mu = math.log(mean) - sigma * sigma / 2
    return max(clip[0], min(clip[1], round(rng.lognormvariate(mu, sigma))))


def zipf_choice(rng: random.Random, n: int, s: float) -> int:
    weights = [1 / (k + 1) ** s for k in range(n)]
    cumulative = []
    total = 0.0
    for w in weights:
        total += w
        cumulative.append(total)
    return bisect.bisect_left(cumulative, rng.random() * total)


def truncated_geometric(rng: random.Random, mean: float, max_value: int) -> int:
    """1, 2, ... with P(k) proportional to (1-p)^(k-1), p = 1/mean, truncated at max_value."""
    p = 1 / mean
    while True:
        k = 1 + int(math.log(1 - rng.random()) / math.log(1 - p))
        if k <= max_value:
            return k


def _ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(count)]


def generate(config: TraceConfig | None = None) -> Trace:
    """The trace for `config`: the same config always gives the same trace, token for token."""
    cfg = config or TraceConfig()
    rng = random.Random(cfg.seed)
    systems = []
    for i in range(cfg.num_system_prompts):
        length = cfg.system_prompt_tokens[i % len(cfg.system_prompt_tokens)]
        systems.append(tuple([IM_START, ROLE_SYSTEM, NEWLINE] + _ids(rng, length) + [IM_END, NEWLINE]))
    sessions = []
    clock = 0.0
    for index in range(cfg.num_sessions):
        clock += rng.expovariate(cfg.session_rate_per_s)
        system = zipf_choice(rng, cfg.num_system_prompts, cfg.zipf_s)
        at = clock
        turns = []
        for _ in range(truncated_geometric(rng, cfg.mean_turns, cfg.max_turns)):
            user_len = lognormal_length(rng, cfg.mean_input, cfg.input_sigma, cfg.input_clip)
            answer_len = lognormal_length(rng, cfg.mean_output, cfg.output_sigma, cfg.output_clip)
            user = [IM_START, ROLE_USER, NEWLINE] + _ids(rng, user_len) + [IM_END, NEWLINE, IM_START,
                                                                            ROLE_ASSISTANT, NEWLINE]
            answer = _ids(rng, answer_len) + [IM_END, NEWLINE]
            turns.append(Turn(at, tuple(user), tuple(answer)))
            think = rng.lognormvariate(math.log(cfg.mean_think_s) - 0.5, 1.0)
            at += answer_len / cfg.decode_tok_per_s + think
        sessions.append(Session(index, system, tuple(turns)))
    return Trace(cfg, tuple(systems), tuple(sessions))


# ----- natural text for the suites that run the real model ------------------------------------

_WORDS = (
    "the a of to and in that is for it on with as was be by this are or from at an but not have has "
    "which you we they can all one will there would their what so if about more when who up out some "
    "time into only other new also how could after first than then them these two may any like now "
    "over such our most even made well way many just where those much before through back long good "
    "system memory cache block token server request answer question model session history turn user "
    "travel booking refund ticket flight hotel price office customer policy luggage airline insurance "
    "garden river mountain city winter summer music library school market kitchen coffee bread window"
).split()


def text_of_tokens(tokenizer, rng: random.Random, tokens: int, prefix: str = "") -> str:
    """Seeded plain English-like text that the tokenizer turns into about `tokens` tokens."""
    words: list[str] = [prefix] if prefix else []
    while True:
        sentence = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 14)))
        words.append(sentence.capitalize() + ".")
        text = " ".join(words)
        if len(tokenizer.encode(text, add_special_tokens=False)) >= tokens:
            ids = tokenizer.encode(text, add_special_tokens=False)[:tokens]
            return tokenizer.decode(ids).strip()


def chat_workload(tokenizer, num_requests: int, system_tokens: int, user_tokens: int,
                  seed: int = 0) -> tuple[str, list[str]]:
    """A shared system prompt and `num_requests` distinct user messages (asking for long answers)."""
    rng = random.Random(seed)
    system = "You are a helpful assistant for a travel agency. " + text_of_tokens(tokenizer, rng, system_tokens - 10)
    users = [text_of_tokens(tokenizer, rng, user_tokens - 12, prefix=f"Question {i}:") +
             " Please explain in detail." for i in range(num_requests)]
    return system, users


def iter_turn_prompts(trace: Trace) -> Iterator[tuple[Event, list[int], int]]:
    """(event, prompt tokens, answer length) for every turn, in arrival order."""
    for event in trace.events():
        yield event, trace.prompt(event.session, event.turn), len(trace.sessions[event.session].turns[event.turn].answer)
