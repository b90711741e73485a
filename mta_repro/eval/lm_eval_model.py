"""The lm-eval (EleutherAI lm-evaluation-harness 0.4.x) model class ``mta_repro``.

``python -m mta_repro.eval.lm_eval_cli --model_args pretrained=<run_dir>,dtype=bfloat16 --tasks ...``
(or the ``mta-lm-eval`` console script: lm-eval's own command line with this model
registered; lm-eval 0.4.13 has no plugin hook, so the bare ``lm_eval`` command cannot
see it), or ``simple_evaluate(model=MTAReproLM(model=..., tokenizer=...), ...)``.
Under ``torchrun`` each process scores its share of the requests (rank/world_size).

Token boundaries: a context is encoded with BOS (as in training) and the continuation
ids are the tail of the encoding of context+continuation (lm-eval's TemplateLM rule,
trailing context spaces move to the continuation). Scores come from one forward pass of
context+continuation[:-1], left-truncated to ``max_length``; batches are right-padded
(causal attention never looks right, so pads change nothing before them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from mta_repro.errors import UserError
from mta_repro.eval.progress import Progress
from mta_repro.model import Transformer
from mta_repro.model.generation import generate_text
from mta_repro.train.config import trained_seq_len


def _init_distributed(device) -> tuple:
    """(rank, world_size): joins the torchrun process group when WORLD_SIZE > 1, so
    that lm-eval gives each process its share of the requests."""
    from mta_repro.eval.dist import init

    return init(device)


class MTAReproLM(TemplateLM):
    def __init__(
        self,
        model: Transformer | None = None,
        tokenizer=None,
        pretrained: str | None = None,
        device: str | None = "auto",
        dtype: str = "float32",
        batch_size: int = 8,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos: bool = True,
        max_batch_size: int | None = None,  # lm-eval passes it; batches are fixed here
        share_prefixes: bool = True,
        **unused,
    ):
        super().__init__()
        if unused:
            raise UserError(f"mta_repro lm-eval model: unknown model_args {sorted(unused)}")
        if batch_size in (None, "auto") or str(batch_size).startswith("auto"):
            batch_size = 8
        self._rank, self._world_size = _init_distributed(device)
        trained_len = None
        if model is None:
            if pretrained is None:
                raise UserError("mta_repro lm-eval model: pass model= or pretrained=<run dir or .pt>")
            from mta_repro.eval.load import load_for_eval

            model, tokenizer, cfg = load_for_eval(pretrained, device=device, dtype=dtype, tokenizer=tokenizer)
            trained_len = trained_seq_len(cfg)
        elif tokenizer is None:
            raise UserError("mta_repro lm-eval model: a model instance needs its tokenizer=")
        else:
            from mta_repro.eval.load import check_vocab

            check_vocab(tokenizer, model)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = int(batch_size)
        # Longest scored context: the length the model was trained on (a run's
        # data.seq_len), never positions it has not seen; longer inputs keep their end
        # (left truncation, as lm-eval's HF model does).
        self.max_length = int(max_length or trained_len or model.args.max_seqlen)
        if isinstance(add_bos, str):
            add_bos = add_bos.lower() == "true"
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos = bool(add_bos)
        if isinstance(share_prefixes, str):
            share_prefixes = share_prefixes.lower() == "true"
        # one forward pass for requests that share their input's start (see _score)
        self.share_prefixes = bool(share_prefixes)
        self.forward_rows = 0  # rows run through the model (for benchmarks and tests)
        self._device = next(model.parameters()).device

    # lm-eval passes its --device/--batch_size as extra keywords besides model_args; lm-eval's
    # default would raise "multiple values for keyword argument 'device'" when model_args names
    # one too. The model_args value wins: it is the more specific of the two.
    @classmethod
    def create_from_arg_string(cls, arg_string, additional_config=None):
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict, additional_config=None):
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    # -- data parallel (lm-eval splits requests by rank/world_size) ---------------------
    def all_gather(self, tensor):
        if self._world_size == 1:
            return tensor
        import torch.distributed as dist

        t = tensor.reshape(-1)
        parts = [torch.zeros_like(t) for _ in range(self._world_size)]
        dist.all_gather(parts, t)
        return torch.cat(parts)

    def gather_object(self, obj, dst=0):
        if self._world_size == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self._world_size if self._rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self._world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    # -- TemplateLM plumbing ----------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_id  # an empty context is just BOS

    @property
    def device(self):
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return type(self.tokenizer).__name__

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list:
        bos = self.add_bos if add_special_tokens is None else add_special_tokens
        return self.tokenizer.encode(string, add_bos=bos, add_eos=False)

    def tok_decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))

    # -- scoring ----------------------------------------------------------------------
    @torch.no_grad()
    def _score(self, pairs: list) -> list:
        """pairs of (context ids, continuation ids) -> (sum logprob, is_greedy), in order.

        Each request's input is (context + continuation)[:-1], left-truncated to
        max_length. Requests whose input is the start of another's input (same context
        and truncation) are read off that row's forward pass: the model is causal, so
        the logits at a position depend only on the tokens up to it. Multiple-choice
        tasks with one-token answers (MMLU's " A".." D") take one pass per question,
        as lm-eval's HF model does with its logits cache; identical requests run once.
        """
        results: list = [None] * len(pairs)
        reqs = []
        for ctx, cont in pairs:
            if not cont:
                raise UserError("lm-eval request with an empty continuation")
            whole = (list(ctx) + list(cont))[-(self.max_length + 1) :]
            inp = whole[:-1]
            n = min(len(cont), len(inp))
            # continuation targets are the last n positions of inp's outputs
            reqs.append((inp, len(inp) - n, len(inp), whole[-n:]))
        # Longest first: the first batch fails fast on memory; batches pad little; a
        # shorter input can only be served by a row already chosen.
        order = sorted(range(len(pairs)), key=lambda i: -len(reqs[i][0]))
        rows: list = []  # inputs that get a forward pass
        served: list = []  # per row: [(request index, start, end, target)]
        by_ctx: dict = {}  # context part of an input -> rows that start with it
        for i in order:
            inp, s, e, target = reqs[i]
            row = None
            if self.share_prefixes:
                key = tuple(inp[:s])
                for r in by_ctx.get(key, ()):
                    if len(rows[r]) >= e and rows[r][s:e] == inp[s:e]:
                        row = r
                        break
            if row is None:
                row = len(rows)
                rows.append(inp)
                served.append([])
                if self.share_prefixes:
                    by_ctx.setdefault(tuple(inp[:s]), []).append(row)
            served[row].append((i, s, e, target))
        self.forward_rows += len(rows)
        progress = Progress("loglikelihood", -(-len(rows) // self.batch_size))
        for start in range(0, len(rows), self.batch_size):
            progress.update()
            batch = range(start, min(start + self.batch_size, len(rows)))
            width = max(len(rows[r]) for r in batch)
            tokens = torch.zeros((len(batch), width), dtype=torch.long, device=self._device)
            for b, r in enumerate(batch):
                tokens[b, : len(rows[r])] = torch.as_tensor(rows[r])
            h = self.model(tokens, return_hidden=True)
            for b, r in enumerate(batch):
                lo = min(s for _, s, _, _ in served[r])
                hi = max(e for _, _, e, _ in served[r])
                logits = self.model.logits(h[b, lo:hi])
                # fp32 at least (bf16 log-softmax loses digits), float64 kept
                logp = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
                for i, s, e, target in served[r]:
                    part = logp[s - lo : e - lo]
                    tgt = torch.as_tensor(target, device=logp.device)
                    ll = float(part.gather(-1, tgt[:, None]).sum())
                    greedy = bool((part.argmax(-1) == tgt).all())
                    results[i] = (ll, greedy)
        progress.close()
        return results

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list:
        out = self._score([(ctx, cont) for _, ctx, cont in requests])
        for (key, _, _), res in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list:
        """Total log-likelihood of each whole string, as a plain float."""
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="loglikelihood_rolling"):
            (string,) = req.args
            ids = self.tok_encode(string, add_special_tokens=False)
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=ids,
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            total = float(sum(ll for ll, _ in self._score(windows)))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    # -- generation -------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list:
        out: list = [None] * len(requests)
        groups: dict = {}
        for i, req in enumerate(requests):  # one generate_text call per kwargs set
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            do_sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 0.0)) if do_sample else 0.0
            top_p = kwargs.pop("top_p", None) if do_sample else None
            key = (tuple(until), max_new, temperature, top_p)
            groups.setdefault(key, []).append((i, context))
        for (until, max_new, temperature, top_p), items in groups.items():
            texts = generate_text(
                self.model,
                self.tokenizer,
                [c for _, c in items],
                max_new,
                until=until,
                max_length=self.max_length,
                batch_size=self.batch_size,
                add_bos=self.add_bos,
                temperature=temperature,
                top_p=top_p,
            )
            for (i, ctx), text in zip(items, texts):
                out[i] = text
                self.cache_hook.add_partial("generate_until", (ctx, {"until": list(until)}), text)
        return out


# Registered after the class, not by decorator: lm-eval types its decorator as returning an LM.
register_model("mta_repro")(MTAReproLM)
