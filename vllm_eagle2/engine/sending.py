"""The drafts a step sends: each request's tree cut to its share of the budget, in one transfer."""

from __future__ import annotations

import torch

from vllm_eagle2.device import to_device
from vllm_eagle2.engine.step_state import DraftChoice, ProposedTrees
from vllm_eagle2.tree import DraftTree, off_leading_chain


def send_drafts(
    tree: DraftTree,
    fits: torch.Tensor,
    eligible: list[bool],
    req_ids: list[str],
    choice: DraftChoice,
    limit: int,
) -> tuple[list[list[int]], ProposedTrees]:
    """The drafts of ``tree`` this step sends, at most ``limit`` per request, cut to the budget's
    counts (None: every allowed node, up to the first one not allowed), and the trees they came
    from, for the next step's verifier.

    fits: [B] bool, the request's tree fits its context; eligible: [B] host, its sampler is one
    the tree verifier reproduces (:mod:`.eligibility`); req_ids: the B request ids; choice: the
    step's drafting choice (its budget, if adaptive, allocates the drafts).
    """
    tokens = tree.tokens
    grafted = tree.grafted if tree.grafted is not None else torch.zeros_like(tokens, dtype=torch.bool)
    # Drafts only where the whole tree fits in max_model_len and the sampler is reproducible,
    # and never a node without a token (a row without a chain, in a step of chains alone).
    n_out = min(limit, tree.num_nodes)
    allowed = (fits & to_device(eligible, fits.device)).unsqueeze(1) & (tokens[:, :n_out] >= 0)
    if choice.budget is None:
        counts = torch.cummin(allowed.to(torch.int8), dim=1).values.sum(dim=1)
    else:
        counts = choice.budget.allocate(
            tree.scores[:, :n_out], tree.depths[:, :n_out], allowed, grafted[:, :n_out], choice.head_skipped
        )
    sent = torch.arange(n_out, device=counts.device) < counts.unsqueeze(1)
    depths = torch.where(sent, tree.depths[:, :n_out], 0)
    off_chain = off_leading_chain(depths)
    # vLLM wants host lists: one transfer brings the drafts, their counts and their shape.
    host = torch.cat([tokens[:, :n_out], counts.unsqueeze(1), off_chain.long(), depths], dim=1).cpu().numpy()
    proposed = ProposedTrees(
        req_ids=req_ids,
        tokens=tokens,
        parents=tree.parents,
        ranks=tree.ranks,
        scores=tree.scores,
        grafted=grafted,
        lookup_buckets=choice.buckets,
        off_chain=host[:, n_out + 1 : 2 * n_out + 1].astype(bool),
        sent_tokens=host[:, :n_out],
        sent_depths=host[:, 2 * n_out + 1 :],
    )
    drafts = [row[:count] for row, count in zip(host[:, :n_out].tolist(), host[:, n_out].tolist())]
    return drafts, proposed
