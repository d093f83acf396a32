"""The head's forward passes, run as vLLM's own EAGLE draft loop runs them.

A mixin of :class:`~vllm_eagle2.engine.proposer.Eagle2Proposer` over vLLM's ``EagleProposer``, whose
persistent input buffers (``input_ids``, ``positions``, ``hidden_states``), batch padding,
attention metadata builders and slot mapping it uses. It is what the draft levels
(:class:`~.expansion.HeadRunner`) and the waiting catch-up rows (:class:`~.catch_up.CatchUpHead`)
see of the drafter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm.forward_context import set_forward_context

if TYPE_CHECKING:
    from vllm.v1.attention.backend import CommonAttentionMetadata


class HeadPasses:
    """Head passes over the proposer's buffers: a draft level, waiting catch-up rows, any pass."""

    head_passes: int  # passes run since start (the engine's stats)

    def run_level(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        parent_hidden: torch.Tensor,
        cad: CommonAttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft level's head pass (:class:`~.expansion.HeadRunner`)."""
        rows = tokens.shape[0]
        # The head's inputs go through the proposer's persistent buffers, as vLLM's own draft loop
        # feeds them: a compiled head was traced on those (int32 ids; a guard-free compiled graph
        # reads an int64 id tensor as int32 pairs, and the drafts after the first level were noise),
        # and its CUDA graphs read them.
        self.input_ids[:rows] = self.vocab.token_ids(tokens)
        self.positions[:rows] = positions
        self.hidden_states[:rows] = parent_hidden
        last_hidden, hidden = self._run_head(cad, rows, first_pass=False)
        return self.vocab.logits(last_hidden), hidden

    def _run_head(
        self, cad: CommonAttentionMetadata, num_tokens: int, *, first_pass: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward over ``num_tokens`` rows with ``cad``'s attention metadata; returns
        (last hidden states, hidden states), each ``[num_tokens, H]``.

        Run as vLLM's own draft loop runs its passes: the inputs come from the proposer's persistent
        buffers (the first pass fills them in ``set_inputs_first_pass``, a level before calling),
        padded to a size the dispatcher knows, and replayed from its piecewise CUDA graph where one
        was captured (vLLM captures the head at start-up). Attention runs between the graph's
        pieces, so the tree side channel still reaches it.
        """
        _, per_layer = self.build_per_group_and_layer_attn_metadata(cad)
        mode, padded, across_dp = self._determine_batch_execution_and_padding(num_tokens)
        if first_pass:
            model_kwargs, slot_size = self.build_model_inputs_first_pass(num_tokens, padded, None)
        else:
            model_kwargs = {
                "input_ids": self.input_ids[:padded],
                "positions": self._get_positions(padded),
                "hidden_states": self.hidden_states[:padded],
            }
            slot_size = padded
        with set_forward_context(
            per_layer,
            self.vllm_config,
            num_tokens=padded,
            num_tokens_across_dp=across_dp,
            cudagraph_runtime_mode=mode,
            slot_mapping=self._get_slot_mapping(slot_size, cad.slot_mapping),
        ):
            out = self.model(**model_kwargs)
        last, hidden = out if self.model_returns_tuple() else (out, out)
        self.head_passes += 1
        return last[:num_tokens], hidden[:num_tokens]

    def catch_up_pass(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        cad: CommonAttentionMetadata,
    ) -> None:
        """One causal head pass over waiting catch-up rows (:class:`~.catch_up.CatchUpHead`)."""
        rows = len(positions)
        if self.method == "eagle3":
            hidden = self.model.combine_hidden_states(hidden)
        self.input_ids[:rows] = tokens
        self.positions[:rows] = positions
        self.hidden_states[:rows] = hidden
        self._run_head(cad, rows, first_pass=True)  # catch-up rows: the head's first pass
