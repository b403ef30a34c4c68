"""Train until a held-out exact match is reached: `--eval-data FILE --stop-at-exact-match X`.

A small model often learns a task in a sudden drop of the loss after a plateau, and when that drop
comes depends on the seed and on the last bits of the CPU's or GPU's arithmetic (measured on the
default task: from step 70 to step 750 across seeds and kernels).  A fixed step count is then
either wasted time or too short.  The gate checks instead: every `eval_steps` optimizer steps it
answers the eval file's prompts greedily and stops the run once the exact match reaches the target;
`epochs` (or `max_steps`) stays the bound.  Every check is logged and kept in train_log.json.

Stopping at once would stop at a high learning rate (a cosine schedule over the bound is still
near its peak when the gate passes early).  So the gate can cool down first (`cooldown`,
warmup-stable-decay's last phase): the rate decays linearly from where it is to zero over that
fraction of the steps trained so far, then the run stops.  On the default task (one run each,
same seed, replay in the data) it took the held-out task from 99.0 % to 100 % and the other
skills kept from 52 / 60 / 78 % to 100 / 95 / 90 %.

The eval file is chat JSONL like the training data: the prompt is the conversation up to its last
assistant message, the reference that message.  Every rank scores the same prompts with the same
(replicated) weights, so all ranks take the same decision; ZeRO-3, whose weights are partitioned,
is refused by the config instead.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from transformers import TrainerCallback

from quantserve.settings import UserError

MAX_EVAL_RECORDS = 500  # a check must stay cheap next to the steps between checks


@dataclass(frozen=True)
class EvalItem:
    messages: list[dict]  # the conversation before the answer
    answer: str


def read_eval_items(path: Path) -> list[EvalItem]:
    """Chat records whose last message is the assistant's reference answer."""
    from quantserve.training.data import read_jsonl

    items = []
    for rec in read_jsonl(path, what="evaluation"):
        if rec.messages is None or rec.messages[-1]["role"] != "assistant":
            raise UserError(f"{path}: line {rec.line}: an eval record needs 'messages' ending in the "
                            "assistant's reference answer")
        items.append(EvalItem(rec.messages[:-1], rec.messages[-1]["content"]))
    if len(items) > MAX_EVAL_RECORDS:
        raise UserError(f"{path}: {len(items)} eval records; at most {MAX_EVAL_RECORDS} (each check "
                        "generates an answer to every one)")
    return items


def exact_match_of(model, tokenizer, items: list[EvalItem], batch_size: int = 64) -> float:
    """Greedy answers to `items` (left-padded batches) against their references."""
    import torch

    from quantserve.modeling import exact_match

    longest = max(len(tokenizer(i.answer, add_special_tokens=False).input_ids) for i in items)
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    was_training = model.training
    model.eval()
    answers: list[str] = []
    try:
        for start in range(0, len(items), batch_size):
            texts = [tokenizer.apply_chat_template(i.messages, tokenize=False, add_generation_prompt=True)
                     for i in items[start:start + batch_size]]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            enc = enc.to(next(model.parameters()).device)
            with torch.no_grad():
                out = model.generate(**enc, max_new_tokens=longest + 4, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            answers.extend(tokenizer.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True))
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return exact_match(answers, [i.answer for i in items])


class ExactMatchGate(TrainerCallback):
    """Scores `items` every `every` steps; once the score reaches `target`, cools the learning
    rate down over `cooldown` x the steps so far, then stops training."""

    def __init__(self, items: list[EvalItem], tokenizer, every: int, target: float | None,
                 cooldown: float = 0.0):
        self.items, self.tokenizer, self.every, self.target = items, tokenizer, every, target
        self.cooldown = cooldown
        self.checks: list[dict] = []
        self.stop_at: int | None = None  # the step the cooldown ends at

    def on_step_end(self, args, state, control, model=None, lr_scheduler=None, **kw):
        if self.stop_at is not None:
            if state.global_step >= self.stop_at:
                self._stop(control)
            return
        if state.global_step % self.every and state.global_step != state.max_steps:
            return
        t0 = time.time()
        score = exact_match_of(model, self.tokenizer, self.items)
        check = {"step": state.global_step, "eval_exact_match": round(score, 4),
                 "seconds": round(time.time() - t0, 2)}
        self.checks.append(check)
        state.log_history.append(dict(check))  # kept in checkpoints, so a resumed run keeps them
        reached = self.target is not None and score >= self.target
        if state.is_world_process_zero:
            goal = f" (target {self.target:.0%}{': reached, stopping' if reached else ''})" if self.target else ""
            print(f"eval: step {state.global_step}: exact match {score:.1%} on {len(self.items)} "
                  f"prompts{goal}", file=sys.stderr, flush=True)
        if not reached:
            return
        steps = round(self.cooldown * state.global_step)
        if steps < 1 or not hasattr(lr_scheduler, "lr_lambdas") or state.global_step + steps > state.max_steps:
            self._stop(control)
            return
        self.stop_at = state.global_step + steps
        start = state.global_step
        for i, rate in enumerate(lr_scheduler.get_last_lr()):
            base = lr_scheduler.base_lrs[i]
            # LambdaLR multiplies its base rate by this factor of the step count
            lr_scheduler.lr_lambdas[i] = (lambda step, f=rate / base: f * max(0.0, 1 - (step - start) / steps))
        if state.is_world_process_zero:
            print(f"eval: cooling the learning rate down to 0 over {steps} steps, then stopping",
                  file=sys.stderr, flush=True)

    @staticmethod
    def _stop(control) -> None:
        control.should_training_stop = True
        control.should_save = False  # the final model is written by train() itself
