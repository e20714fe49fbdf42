"""Mutation testing: do the tests notice when a rule of the chapter is broken?

Each mutant below is one small, realistic bug: an exact snippet of nanoserve's source, its
replacement, what it breaks and the rule (chapter section or sampling knob) it violates.
They are planted one at a time into a temporary copy of the working tree (the tree itself
is never touched) and the fast tests run against each; a mutant is "killed" when a test
fails. A mutant whose snippet no longer occurs in the source is reported "stale": update
its snippet after the code it targets changes (tests/support/test_mutants.py fails first). A
mutant whose code cannot run on this CPU (the AMX GEMM's, without AMX: its tests skip) is not
run and is named as such, not counted as a survivor.

    python scripts/dev/mutate.py            # every mutant against the fast tests (minutes)
    python scripts/dev/mutate.py --full     # then the whole suite, slow tests too, on survivors
    python scripts/dev/mutate.py --list     # the mutants and their rules
    python scripts/dev/mutate.py top_p      # only mutants whose name contains "top_p"
    python scripts/dev/mutate.py server detok stop_string --tests tests/server/test_*.py
                                            # the server's and detokenizer's, on its tests only

Run it before a change to the scheduler, block manager or sampler is called done. Hypothesis
runs derandomized (profile "mutate" in tests/conftest.py), so results are reproducible.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def cpu_flags() -> frozenset[str]:
    """nanoserve/utils/cpu.py's, loaded from its file: importing the package here would make
    every run's `import nanoserve` this tree's, not the mutated copy's."""
    spec = importlib.util.spec_from_file_location("mutate_cpu", ROOT / "nanoserve/utils/cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.cpu_flags()
# Model-free tests first, then those that build a tiny LLM: with -x the first failing test
# ends the run. A mutant's own module's tests go first (see `ordered`).
FAST_TESTS = ["tests/core/test_scheduler.py", "tests/core/test_scheduler_vllm.py",
              "tests/core/test_sampler.py", "tests/core/test_sampling.py",
              "tests/core/test_stop_tokens.py", "tests/core/test_properties.py",
              "tests/core/test_abort.py", "tests/core/test_validation.py",
              "nanoserve_accel/tests/test_linear.py",
              "nanoserve_accel/tests/test_paged_attention.py",
              "nanoserve_accel/tests/test_fused.py",
              "nanoserve_accel/tests/test_amx.py", "nanoserve_accel/tests/test_dot_fp32.py",
              "nanoserve_accel/tests/test_layer.py",
              "nanoserve_accel/tests/test_prefill_attention.py",
              "nanoserve_accel/tests/test_fast_path.py",
              "tests/server/test_engine_thread.py", "tests/server/test_validation.py",
              "tests/server/test_forwarding.py", "tests/server/test_attacks.py",
              "tests/server/test_shutdown.py", "tests/server/test_server.py",
              "tests/server/test_vllm_fields.py", "tests/server/test_reasoning.py",
              "tests/server/test_launch_flags.py", "tests/server/test_tool_calls.py"]
A, AC, AT = "nanoserve_accel/", "nanoserve_accel/csrc/", "nanoserve_accel/tests/"
FIRST = {"nanoserve/layers/sampler.py": ["tests/core/test_sampler.py",
                                         "tests/core/test_sampling.py"],
         "nanoserve/engine/block_manager.py": ["tests/core/test_scheduler_vllm.py"],
         AC + "linear.c": [AT + "test_linear.py"],
         AC + "attention.c": [AT + "test_paged_attention.py"],
         AC + "attention_avx512.c": [AT + "test_paged_attention.py"],
         AC + "fused.c": [AT + "test_fused.py"],
         AC + "amx.c": [AT + "test_amx.py"],
         AC + "dot_fp32.c": [AT + "test_dot_fp32.py"],
         AC + "kernels.h": [AT + "test_paged_attention.py"],
         A + "__init__.py": [AT + "test_fast_path.py"],
         A + "linear.py": [AT + "test_linear.py"],
         AC + "layer.c": [AT + "test_layer.py"],
         AC + "attention_prefill.c": [AT + "test_prefill_attention.py"],
         A + "paged_attention.py": [AT + "test_prefill_attention.py",
                                                AT + "test_paged_attention.py"],
         A + "layer.py": [AT + "test_layer.py"],
         A + "plan.py": [AT + "test_linear.py"],
         "nanoserve/models/decoder.py": [AT + "test_fast_path.py"],
         "nanoserve/serve.py": ["tests/server/test_engine_thread.py"]}
# The server's and the detokenizer's mutants: the server test that should catch each first.
SRV, E = "tests/server/", "nanoserve/entrypoints/"
FIRST.update({E + "engine_thread.py": [SRV + "test_engine_thread.py", SRV + "test_shutdown.py"],
              E + "api_server.py": [SRV + "test_server.py", SRV + "test_attacks.py",
                                    SRV + "test_shutdown.py"],
              E + "serving_engine.py": [SRV + "test_forwarding.py", SRV + "test_validation.py"],
              E + "serving_completion.py": [SRV + "test_forwarding.py",
                                            SRV + "test_vllm_fields.py"],
              E + "serving_chat.py": [SRV + "test_vllm_fields.py", SRV + "test_launch_flags.py"],
              E + "choices.py": [SRV + "test_vllm_fields.py"],
              E + "generation_config.py": [SRV + "test_forwarding.py"],
              E + "protocol.py": [SRV + "test_forwarding.py"],
              E + "request_prompts.py": [SRV + "test_forwarding.py"],
              E + "reasoning_parser.py": [SRV + "test_reasoning.py"],
              E + "tool_parser.py": [SRV + "test_tool_calls.py"],
              E + "launcher.py": [SRV + "test_shutdown.py"],
              E + "body_checker.py": [SRV + "test_body_checker.py"],
              E + "metrics.py": [SRV + "test_forwarding.py"],
              E + "validation.py": [SRV + "test_validation.py"],
              E + "http_limits.py": [SRV + "test_attacks.py"],
              E + "detokenizer.py": [SRV + "test_forwarding.py", "tests/core/test_detokenizer.py"]})
PYTEST = ["-x", "-q", "-p", "no:cacheprovider"]

SCHED = "nanoserve/engine/scheduler.py"
BM = "nanoserve/engine/block_manager.py"
RUNNER = "nanoserve/engine/model_runner.py"
SAMPLER = "nanoserve/layers/sampler.py"
QUEUE = "nanoserve/engine/waiting_queue.py"
GEMM, ATTN = "nanoserve_accel/csrc/linear.c", "nanoserve_accel/csrc/attention.c"
HEADER, ACCEL = "nanoserve_accel/csrc/kernels.h", "nanoserve_accel/__init__.py"
DISPATCH, PLAN = "nanoserve_accel/linear.py", "nanoserve_accel/plan.py"
DECODER = "nanoserve/models/decoder.py"
WIDE, FUSED = "nanoserve_accel/csrc/attention_avx512.c", "nanoserve_accel/csrc/fused.c"
AMX, DOT32 = "nanoserve_accel/csrc/amx.c", "nanoserve_accel/csrc/dot_fp32.c"
LAYER_C, LAYER = "nanoserve_accel/csrc/layer.c", "nanoserve_accel/layer.py"
SERVE = "nanoserve/serve.py"
EP = "nanoserve/entrypoints/"
API, SERVING, LAUNCHER = EP + "api_server.py", EP + "serving_engine.py", EP + "launcher.py"
PROTOCOL = EP + "protocol.py"
METRICS, DETOK, CHECKS = EP + "metrics.py", EP + "detokenizer.py", EP + "validation.py"
LIMITS, ENGINE_THREAD = EP + "http_limits.py", EP + "engine_thread.py"
PREFILL_C, PAGED = "nanoserve_accel/csrc/attention_prefill.c", "nanoserve_accel/paged_attention.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    original: str
    replacement: str
    description: str
    rule: str
    needs: str | None = None  # a CPU flag the code needs to run at all (its tests skip without)


MUTANTS = [
    # -- §6.2: the order of decisions in one schedule step --------------------------------
    Mutant("admit_after_preempt", SCHED,
           "while not out.preempted and self.waiting and token_budget > 0:",
           "while self.waiting and token_budget > 0:",
           "waiting requests admitted in a step that preempted",
           "§6.2: admit only if nothing was preempted this step"),
    Mutant("budget_not_charged_admitted", SCHED,
           "            self._add_to_output(req, num_new, out)\n"
           "            token_budget -= num_new\n        return out",
           "            self._add_to_output(req, num_new, out)\n        return out",
           "admitted chunks do not spend the token budget",
           "§6.2: every scheduled token is charged to token_budget"),
    Mutant("budget_not_charged_running", SCHED,
           "            self._add_to_output(req, num_new, out)\n"
           "            token_budget -= num_new\n\n",
           "            self._add_to_output(req, num_new, out)\n\n",
           "running requests' tokens do not spend the token budget",
           "§6.2: every scheduled token is charged to token_budget"),
    Mutant("max_num_seqs_off_by_one", SCHED,
           "return len(self.running) < self.config.max_num_seqs",
           "return len(self.running) <= self.config.max_num_seqs",
           "one request more than max_num_seqs runs",
           "§6.2/§7: running <= max_num_seqs"),
    Mutant("admitted_joins_front_of_running", SCHED,
           "        self.running.append(req)\n",
           "        self.running.appendleft(req)\n",
           "a newly admitted request is served before the requests already running",
           "§6.2: running requests first, in the order they joined"),
    Mutant("long_prefill_threshold_ignored", SCHED,
           "cap = None if alone else self.config.long_prefill_token_threshold", "cap = None",
           "long_prefill_token_threshold does not cap a prefill chunk",
           "§7: chunked prefill caps each chunk"),
    Mutant("long_prefill_cap_when_alone", SCHED,
           "alone = len(self.running) + len(self.waiting) <= 1", "alone = False",
           "long_prefill_token_threshold caps a request that is alone in the scheduler",
           "§7 (vLLM 0.32): the chunk cap applies only when other requests run or wait"),
    Mutant("admission_checks_first_chunk_only", SCHED,
           "full_sequence_must_fit=True", "full_sequence_must_fit=False",
           "a waiting or preempted request is admitted when only its first chunk fits",
           "§6.2 (vLLM 0.32): admission reserves the blocks of the whole current sequence"),
    Mutant("priority_ties_ignore_arrival", QUEUE,
           "key=lambda r: (r.priority, r.arrival_time))", "key=lambda r: r.priority)",
           "the PRIORITY waiting queue orders by priority alone: a preempted request goes "
           "behind later arrivals of its priority",
           "§6.1: PRIORITY waits in (priority, arrival_time) order, preempted or not"),
    # -- §6.3: preemption by recompute ----------------------------------------------------
    Mutant("fcfs_victim_first_running", SCHED,
           "return self.running[-1]", "return self.running[0]",
           "FCFS preempts the first running request instead of the last",
           "§6.3: FCFS evicts the request that joined running last"),
    Mutant("priority_victim_ignores_arrival", SCHED,
           "key=lambda r: (r.priority, r.arrival_time))", "key=lambda r: r.priority)",
           "PRIORITY victim: ties on priority not broken by the latest arrival",
           "§6.3: PRIORITY evicts the largest (priority, arrival_time)"),
    Mutant("preempt_refund_lost", SCHED,
           "token_budget += self._preempt_request(victim, out)",
           "self._preempt_request(victim, out)",
           "a victim that was already scheduled does not give its tokens back to the step",
           "§6.2/§6.3: a preempted request leaves the batch and the budget"),
    Mutant("preempted_to_back_of_waiting", SCHED,
           "self.waiting.push_front(victim)", "self.waiting.push(victim)",
           "a preempted request queues behind requests that never ran",
           "§6.3: a preempted request goes back to the front of waiting"),
    Mutant("preempt_keeps_num_computed", SCHED,
           "victim.num_computed_tokens, victim.status = 0, RequestStatus.PREEMPTED",
           "victim.status = RequestStatus.PREEMPTED",
           "a preempted request keeps its num_computed_tokens",
           "§6.3: preemption by recompute resets num_computed_tokens to 0"),
    Mutant("preempt_keeps_blocks", SCHED,
           "        self.running.remove(victim)\n        self.block_manager.free(victim)\n",
           "        self.running.remove(victim)\n        victim.block_table = []\n",
           "a preempted request's blocks are never returned to the pool",
           "§6.3: preemption frees the victim's KV blocks"),
    # -- §3/§4: processing the step's output ----------------------------------------------
    Mutant("stop_token_ids_ignored", SCHED,
           "or last in params.stop_token_ids:", "or False:",
           "stop_token_ids never stop a request",
           "§4: stop on a stop token"),
    Mutant("ignore_eos_ignored", SCHED,
           "(not params.ignore_eos and last in req.eos_token_ids)",
           "(last in req.eos_token_ids)",
           "ignore_eos=True still stops at EOS",
           "§4: EOS stops unless ignore_eos"),
    Mutant("max_tokens_off_by_one", SCHED,
           "req.num_output_tokens >= params.max_tokens",
           "req.num_output_tokens > params.max_tokens",
           "one token more than max_tokens",
           "§4: stop at max_tokens"),
    Mutant("finished_blocks_not_freed", SCHED,
           "        for req in finished:\n            self.block_manager.free(req)\n",
           "        for req in finished:\n            req.block_table = []\n",
           "a finished request's blocks are not returned",
           "§3: a finished request frees its blocks at once"),
    Mutant("abort_keeps_blocks", SCHED,
           "                self.running.remove(req)\n"
           "                self.block_manager.free(req)\n",
           "                self.running.remove(req)\n",
           "aborting a running request leaks its blocks",
           "§3/§5: a request that leaves frees its blocks"),
    # -- §5: the block manager and prefix caching -----------------------------------------
    Mutant("cache_uncomputed_full_blocks", BM,
           "num_full = req.num_computed_tokens // bs",
           "num_full = min(req.num_tokens, len(req.block_table) * bs) // bs",
           "cache_full_blocks registers full blocks whose KV is not computed yet",
           "§5: a hash must not promise KV that was never written"),
    Mutant("hash_not_chained", BM,
           '(parent_hash or b"") + array("q", token_ids)', 'array("q", token_ids)',
           "a block's hash ignores its parent: equal blocks after different prefixes collide",
           "§5: block hashes are chained from the parent's hash"),
    Mutant("last_token_from_cache", BM,
           "num_full = (req.num_tokens - 1) // bs",
           "num_full = req.num_tokens // bs",
           "a fully cached prompt takes its last token from the cache (no logits to sample)",
           "§5: the last token is always computed"),
    Mutant("evicted_block_keeps_hash", BM,
           "            block.block_hash = None\n", "",
           "a reused (evicted) block keeps its old hash: stale KV is found as a hit",
           "§5: eviction forgets the block's prefix"),
    Mutant("eviction_takes_newest", BM,
           "block_id, _ = self.free_blocks.popitem(last=False)",
           "block_id, _ = self.free_blocks.popitem(last=True)",
           "allocation takes the most recently freed block (evicts the hottest prefix)",
           "§5: least recently freed cached blocks are evicted first"),
    Mutant("uncached_blocks_not_taken_first", BM,
           "        for block_id in reversed(unhashed):  # the run's last block first, so its "
           "first leads\n            self.free_blocks.move_to_end(block_id, last=False)\n", "",
           "freed blocks holding nothing reusable are not taken before cached ones",
           "§5: evict cached prefixes only when no empty block is left"),
    Mutant("free_head_first", BM,
           "for block_id in reversed(req.block_table):", "for block_id in req.block_table:",
           "a freed request's prefix head is evicted before its tail",
           "§5: among one request's cached blocks, the prefix head is evicted last"),
    Mutant("uncached_blocks_prepended_one_by_one", BM,
           "                    unhashed.append(block_id)\n",
           "                    self.free_blocks.move_to_end(block_id, last=False)\n",
           "a freed request's unhashed blocks reach the front one at a time: head first, "
           "its tail reused last",
           "§5 (vLLM's BlockPool.free_blocks): unhashed blocks go to the front as one run, "
           "tail first"),
    Mutant("resumed_lookup_counted_as_first", BM,
           "            if req.num_preemptions:\n", "            if False:\n",
           "a resumed request's prefix lookup counts in prefix_cache_hit_rate",
           "§5 (vLLM's PrefixCacheStats): resumptions go to the preempted_* counters"),
    Mutant("revived_blocks_counted_as_room", BM,
           "num_revived = sum(1 for b in computed if self.blocks[b].ref_count == 0)",
           "num_revived = 0",
           "cached blocks leaving the free pool are also counted as room for new blocks",
           "§5: allocation is all or nothing, never over the pool"),
    Mutant("shared_block_refcount_reset", BM,
           "            block.ref_count += 1\n", "            block.ref_count = 1\n",
           "a shared prefix block's ref_count is reset instead of incremented",
           "§5: a shared block is freed only when its last user leaves"),
    # -- §5: slots and block tables the model reads (step_inputs) -------------------------
    Mutant("slot_mapping_off_by_one", RUNNER,
           "req.block_table[p // block_size] * block_size + p % block_size",
           "req.block_table[p // block_size] * block_size + (p + 1) % block_size",
           "each token's K/V is written one slot off",
           "§5: slot = block_table[pos // block_size] * block_size + pos % block_size"),
    Mutant("slot_in_last_block", RUNNER,
           "req.block_table[p // block_size] * block_size + p % block_size",
           "req.block_table[-1] * block_size + p % block_size",
           "every token is written into the request's last block",
           "§5: each position lives in its own block of the block table"),
    Mutant("context_len_off_by_one", RUNNER,
           "[start + 1 for _, start, _, _ in decode_rows], block_tables(decode_rows),",
           "[start for _, start, _, _ in decode_rows], block_tables(decode_rows),",
           "a decode reads one token less than its context",
           "§5: a decode attends to all its computed tokens and itself"),
    # -- sampling knobs -------------------------------------------------------------------
    Mutant("top_p_cumsum_includes_token", SAMPLER,
           "mass_before = probs.cumsum(dim=-1) - probs", "mass_before = probs.cumsum(dim=-1)",
           "top_p drops the token that crosses the mass",
           "top_p keeps the smallest prefix reaching the mass"),
    Mutant("top_p_tie_kept", SAMPLER,
           "mass_before >= meta.top_p", "mass_before > meta.top_p",
           "top_p keeps one token more when the mass is reached exactly",
           "top_p keeps the smallest prefix reaching the mass"),
    Mutant("top_k_keeps_k_plus_1", SAMPLER,
           "values.masked_fill(rank >= meta.top_k", "values.masked_fill(rank > meta.top_k",
           "top_k keeps k + 1 tokens", "top_k keeps exactly k"),
    Mutant("temperature_ignored", SAMPLER,
           "logits = logits / meta.temperature.unsqueeze(1)", "logits = logits",
           "temperature does not scale the logits", "temperature sharpens / flattens"),
    Mutant("seed_generator_ignored", SAMPLER,
           "vocab, device=probs.device, generator=generator)",
           "vocab, device=probs.device, generator=self.generator)",
           "a seeded request draws from the engine's generator",
           "seed: a request's draws are reproducible, whatever its batch"),
    Mutant("seeded_row_uses_batch_row_generator", SAMPLER,
           "{j: generators[i] for j, i in enumerate(rows) if generators[i] is not None}",
           "{j: generators[j] for j, i in enumerate(rows) if generators[j] is not None}",
           "a sampled row draws from the generator of the j-th batch row, not its own request's",
           "seed: each request draws from its own generator, whatever rows precede it"),
    Mutant("sampled_row_mixed_up", SAMPLER,
           "self.filter(logits[meta.rows].float(), meta)",
           "self.filter(logits[:len(meta.rows)].float(), meta)",
           "a sampled row draws from another row's probabilities",
           "each row samples from its own logits"),
    # -- the fast paths compute what the reader's torch computes -----------------------------
    Mutant("gemm_prefetch_pass_skips_k", GEMM,
           "k < k0 + passes && k < K;", "k < k0 + passes - 1 && k < K;",
           "the prefetching GEMM loop skips one k in every `passes`",
           "§1: the packed GEMM equals nn.Linear"),
    Mutant("gemm_five_row_block_skips_a_row", GEMM,
           "gemm_block(x, w, panel, bias, y, M, N, K, p, m0, 5, 0, 0, pass,",
           "gemm_block(x, w, panel, bias, y, M, N, K, p, m0, 4, 0, 0, pass,",
           "the fp32 GEMM's 5-row block computes only 4 of its rows",
           "§1: the packed GEMM equals nn.Linear"),
    Mutant("decode_reads_past_the_cache", ATTN,
           "if (id < 0 || id >= num_blocks) return b;", "if (id < 0) return b;",
           "the C decode kernel reads a block id past the cache",
           "a bad block id is a ValueError, never a read outside the cache"),
    Mutant("cache_write_past_the_cache", ATTN,
           "if (slots[i] < 0 || slots[i] >= num_slots) return i;", "if (slots[i] < 0) return i;",
           "the C cache write takes a slot past the cache",
           "a bad slot is a ValueError, never a write outside the cache"),
    Mutant("gemm_widened_panel_is_panel_0", GEMM,
           "wide[j] = load(w, panel + j, 1);", "wide[j] = load(w, j, 1);",
           "the bf16 GEMM widens the first panel for every panel of a multi-pass call",
           "§1: the packed GEMM equals nn.Linear"),
    Mutant("attention_bf16_row_cut_short", ATTN,
           "for (int i = 0; i < row; i += 8) {", "for (int i = 8; i < row; i += 8) {",
           "the decode kernel widens a bf16 K/V row but its first 8 values",
           "§5: the decode kernel equals naive attention"),
    Mutant("attention_tile_reads_one_row", ATTN,
           "rows[i] = row_floats(cache, offsets[t + i], row, bf16, tmp + i * row);",
           "rows[i] = row_floats(cache, offsets[t], row, bf16, tmp + i * row);",
           "the bf16 decode kernel reads each tile of 4 tokens as its first token's K and V",
           "§5: the decode kernel equals naive attention"),
    Mutant("sum8_adds_a_lane_twice", HEADER,
           "a + __builtin_shufflevector(a, a, 1, 0, 3, 2);",
           "a + __builtin_shufflevector(a, a, 2, 0, 3, 2);",
           "the 8-lane sum that every kernel's dot product ends with adds one lane twice",
           "§5: the decode kernel equals naive attention"),
    Mutant("freed_buffers_returned_to_the_os", ACCEL,
           "    kernels.keep_freed_memory()", "    pass",
           "the CPU fast path leaves glibc to page-fault each step's large buffers in again",
           "the fast path removes the costs it names"),
    Mutant("decode_kernel_not_bound", RUNNER,
           "attn.bind(self.kv_cache[0, i], self.kv_cache[1, i], self.backend)",
           "attn.bind(self.kv_cache[0, i], self.kv_cache[1, i],\n"
           "                      get_backend(self.config.attention_backend))",
           "the layers keep the twin although the runner names the decode kernel",
           "the fast path swaps in what it says it does"),
    Mutant("bf16_gemm_ignores_native_units", PLAN,
           "if dtype == torch.bfloat16 and native_bf16:", "if dtype == torch.bfloat16:",
           "bf16 goes to oneDNN even where the CPU must emulate it",
           "each CPU gets the GEMM measured faster on it"),
    Mutant("onednn_handover_one_row_late", DISPATCH,
           "x.numel() > self.max_rows * self.k", "x.numel() > (self.max_rows + 1) * self.k",
           "a C GEMM hands a batch to oneDNN only above max_rows + 1 rows, not above max_rows",
           "each CPU gets the GEMM measured faster on it, by row count"),
    Mutant("merged_gate_and_up_swapped", DECODER,
           "gate, up = gate_up.chunk(2, dim=-1)", "up, gate = gate_up.chunk(2, dim=-1)",
           "the merged MLP takes SiLU of the up projection instead of the gate's",
           "the reader's decoder computes what HF's computes (and the fast path what it does)"),
    Mutant("wide_attention_scores_unscaled", WIDE,
           "_mm512_mul_ps(sum_lanes16(s), _mm512_set1_ps(scale))", "sum_lanes16(s)",
           "the AVX-512 decode kernel forgets the softmax scale",
           "§5: the decode kernel equals naive attention"),
    Mutant("wide_attention_lane_order", WIDE,
           "_mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15)",
           "_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)",
           "the 16-score lane sum puts tokens 4-11 in the wrong order",
           "§5: the decode kernel equals naive attention"),
    Mutant("wide_attention_group_tail_skipped", WIDE,
           "      h -= most - hn; /* the next group starts at h + hn */\n", "",
           "the AVX-512 V pass skips the heads after a split group's first 4",
           "§5: the decode kernel equals naive attention (GQA)"),
    Mutant("rms_norm_not_rounded_before_weight", FUSED,
           "rounded(load(x, row + i, bf16) * inv, bf16)", "load(x, row + i, bf16) * inv",
           "the fused bf16 RMSNorm multiplies the weight before rounding, unlike torch",
           "the fast path computes what the reader's decoder computes"),
    Mutant("rope_second_half_sign", FUSED,
           "rounded(x2 * load(cos, c + i + half, bf16), bf16) +",
           "rounded(x2 * load(cos, c + i + half, bf16), bf16) -",
           "the fused RoPE subtracts where rotate_half adds",
           "the fast path computes what the reader's decoder computes"),
    Mutant("silu_of_up", FUSED,
           "load(gate_up, g0 + I + i, bf16),", "load(gate_up, g0 + i, bf16),",
           "the fused SiLU-and-multiply multiplies by the gate again instead of up",
           "the fast path computes what the reader's decoder computes"),
    Mutant("amx_bias_of_group_0", AMX,
           "_mm256_loadu_si256((const __m256i*)bias + g)), 16));",
           "_mm256_loadu_si256((const __m256i*)bias)), 16));",
           "the AMX GEMM adds the first 16 columns' bias to every column group",
           "§1: the AMX GEMM equals nn.Linear", needs="amx_bf16"),
    Mutant("amx_third_block_reuses_the_first", AMX,
           "_tile_loadd(5, a + 32 * x_stride, x_stride);", "_tile_loadd(5, a, x_stride);",
           "the AMX GEMM's rows 32-47 get rows 0-15's sums",
           "§1: the AMX GEMM equals nn.Linear", needs="amx_bf16"),
    Mutant("dot_fp32_tail_unmasked_lane", DOT32,
           "const __mmask16 mask = (__mmask16)((1u << (K - k)) - 1);",
           "const __mmask16 mask = (__mmask16)((1u << (K - k)) - 2);",
           "the fp32 dot-product GEMM drops the first value of the K tail",
           "§1: the dot-product GEMM equals nn.Linear"),
    Mutant("layer_mlp_residual_from_the_input", LAYER_C,
           "  add(out, h, out, n, L->hidden, L->bf16);", "  add(x, h, out, n, L->hidden, L->bf16);",
           "the one-call layer adds the MLP's output to the layer's input, not to x + attention",
           "§4: the one-call layer computes what the modules compute"),
    Mutant("layer_post_norm_is_the_input_norm", LAYER_C,
           "add_rms_norm(x, h, L->post_norm, out, h,", "add_rms_norm(x, h, L->input_norm, out, h,",
           "the one-call layer normalizes before the MLP with the attention's RMSNorm weight",
           "§4: the one-call layer computes what the modules compute"),
    Mutant("layer_caches_one_kv_head", LAYER_C,
           "slots, n, kv_width * esize,", "slots, n, L->D * esize,",
           "the one-call layer writes only the first KV head of each new token into the cache",
           "§5: each token's K and V go into its slot of the paged cache"),
    Mutant("layer_ignores_the_gemm_row_limit", LAYER,
           "meta.num_decode_tokens != n or n > max_rows  #", "meta.num_decode_tokens != n  #",
           "the one-call layer runs C GEMMs past the rows where the modules hand over to oneDNN",
           "the dispatch rule decides the GEMM by row count, in every path"),
    Mutant("llm_built_on_the_main_thread", ENGINE_THREAD,
           "self.build, self.num_threads = build, num_threads",
           "self.build, self.num_threads = (lambda llm=build(): llm), num_threads",
           "the server builds the LLM on the thread that starts it, not on the engine thread",
           "one engine thread owns the LLM (and only it starts an OpenMP team)"),
    Mutant("prefill_misses_its_own_token", PREFILL_C,
           "visible[i] = at[i] >= 0 ? before + task->row0 + v / G + 1 : 0;",
           "visible[i] = at[i] >= 0 ? before + task->row0 + v / G : 0;",
           "the C prefill attention leaves each query's own token out of its keys",
           "§5: causal attention, a query sees its own and earlier tokens only"),
    Mutant("prefill_keeps_an_out_of_range_answer", PAGED,
           "return out if bad == -1 else backend.varlen_func(*args)", "return out",
           "the prefill wrapper returns its unwritten output when the kernel refused the input",
           "bad input is an error naming what is wrong, never garbage"),
    Mutant("fast_path_in_eager_mode", RUNNER,
           "fast_paths() if config.enable_fast_paths else []:", "fast_paths():",
           "enable_fast_paths=False still swaps in the fast paths",
           "the reader's plain path is one flag away"),
    # -- the server (nanoserve/entrypoints/): fields on their way to the engine and back ---
    Mutant("server_api_key_substring", API,
           "matches = sum(hmac.compare_digest(given, key) for key in self.api_keys)",
           "matches = any(key in given for key in self.api_keys)",
           "any Authorization header that merely contains the key is accepted",
           "--api-key: exactly 'Bearer KEY'"),
    Mutant("server_missing_model_is_404", PROTOCOL,
           "if requested and requested not in served:", "if requested not in served:",
           "a request without `model` is answered 404",
           "vLLM: `model` may be left out"),
    Mutant("server_prompt_list_of_text_refused", EP + "request_prompts.py",
           "isinstance(prompt[0], (str, list))", "isinstance(prompt[0], list)",
           'prompt: ["text"] is not taken as the prompt "text"',
           "OpenAI: a prompt may be a list of one"),
    Mutant("server_max_tokens_context_off_by_one", CHECKS,
           "and max_tokens > max_model_len:",
           "and max_tokens >= max_model_len:",
           "max_tokens exactly max_model_len is refused",
           "vLLM: max_tokens up to max_model_len, then the prompt's room"),
    Mutant("server_include_stop_str_dropped", EP + "generation_config.py",
           "include_stop_str_in_output=req.include_stop_str_in_output,",
           "include_stop_str_in_output=False,",
           "include_stop_str_in_output never reaches the engine",
           "every field the server accepts is forwarded"),
    Mutant("server_truncation_side_ignored", SERVING,
           'ids[:keep] if req.truncation_side == "right" else ids[-keep:]', "ids[-keep:]",
           'truncation_side "right" keeps the last tokens', "vLLM's truncation_side"),
    Mutant("server_token_ids_not_as_ids", EP + "choices.py",
           "parser=parser and parser(), as_token_ids=as_ids,",
           "parser=parser and parser(), as_token_ids=False,",
           "return_tokens_as_token_ids is ignored", "no vLLM field is silently ignored"),
    Mutant("server_chat_stream_ids_whole", EP + "serving_chat.py",
           '"token_ids": choice.new_ids if delta else choice.token_ids}',
           '"token_ids": choice.token_ids}',
           "a streamed chat chunk repeats every token id so far", "each chunk its own ids"),
    Mutant("server_reasoning_tag_not_held_back", EP + "reasoning_parser.py",
           "keep = 0 if final else max(", "keep = 0 * max(",
           "a </think> cut across two streamed pieces is sent as reasoning text",
           "a tag's start is held back until known"),
    Mutant("server_reasoning_tokens_all_counted", EP + "reasoning_parser.py",
           "ids.index(self.end_id) + 1 if self.end_id in ids else len(ids)", "len(ids)",
           "the tokens after </think> in its piece count as reasoning",
           "reasoning_tokens: those up to the </think> token"),
    Mutant("server_llama_python_tag_is_text", EP + "tool_parser.py",
           'head.startswith(("{", PYTHON_TAG))', 'head.startswith("{")',
           "a Llama call after its <|python_tag|> is taken as text",
           "vLLM's llama3_json: the tag may come first"),
    Mutant("server_default_template_kwargs_over_the_requests", EP + "serving_chat.py",
           "{**defaults, **(kwargs or {})}", "{**(kwargs or {}), **defaults}",
           "--default-chat-template-kwargs override the request's own options",
           "vLLM's: the request's options over the server's defaults"),
    Mutant("server_usage_without_include_usage", SERVING,
           "elif options.include_usage:  #", "else:  #",
           "a usage chunk is streamed for include_usage: false",
           "vLLM: the usage chunk only when asked"),
    Mutant("server_metrics_readd_totals", METRICS,
           "counter.inc(new - old)", "counter.inc(new)",
           "/metrics adds the engine's running totals again at every step",
           "/metrics counts what the engine counted"),
    Mutant("server_prompt_tokens_every_step", METRICS,
           "            if out.finished:\n                self.prompt_tokens.inc(",
           "            if True:\n                self.prompt_tokens.inc(",
           "prompt tokens are counted at every streamed step, not once per request",
           "/metrics counts what the engine counted"),
    Mutant("detok_stream_tail_lost", DETOK,
           'full.endswith("\\ufffd") and not req.is_finished', 'full.endswith("\\ufffd")',
           "a stream cut mid-character never sends its last (incomplete) character",
           "§4: DELTA texts join to the final text"),
    Mutant("detok_special_tokens_leak", DETOK,
           "self.skip_special = params.stop_token_ids, params.skip_special_tokens",
           "self.skip_special = params.stop_token_ids, False",
           "special tokens (<|im_end|>, ...) come out as text",
           "vLLM: skip_special_tokens by default"),
    Mutant("detok_eos_as_stop_reason", DETOK,
           "and self.token_ids and self.token_ids[-1] in self.stop_token_ids):",
           "and self.token_ids):",
           "a request ended by EOS reports the EOS id as its stop_reason",
           "vLLM: stop_reason None for EOS, the id for a stop token"),
    Mutant("detok_holdback_ignored", DETOK,
           "end = len(self.text) if req.is_finished else len(self.text) - self.holdback",
           "end = len(self.text)",
           "while streaming, the start of a stop string is sent before it is known",
           "§4: a stop string never reaches the client"),
    Mutant("stop_string_checked_after_length", SCHED,
           "        if params.stop and self.stop_string_in is not None and "
           "self.stop_string_in(req):\n"
           "            return FinishReason.STOP\n"
           "        if (params.max_tokens is not None and "
           "req.num_output_tokens >= params.max_tokens\n"
           "                or req.num_tokens >= self.max_model_len_in_cache):  # max_tokens None: "
           "the context\n"
           "            return FinishReason.LENGTH\n",
           "        if (params.max_tokens is not None and "
           "req.num_output_tokens >= params.max_tokens\n"
           "                or req.num_tokens >= self.max_model_len_in_cache):  # max_tokens None: "
           "the context\n"
           "            return FinishReason.LENGTH\n"
           "        if params.stop and self.stop_string_in is not None and "
           "self.stop_string_in(req):\n"
           "            return FinishReason.STOP\n",
           'a stop string completed by the last allowed token is labelled "length"',
           "vLLM: stop conditions before the length limits"),
    # -- the server under attack -----------------------------------------------------------
    Mutant("server_numbers_not_strict", CHECKS,
           "model.model_validate(body, strict=True)", "model.model_validate(body)",
           'true and "3" pass as numbers, 1.0 as a token id',
           "bad input is a 400 naming the field"),
    Mutant("server_surrogates_unchecked", CHECKS,
           "        _check_utf8(json.dumps(value, ensure_ascii=False), field)\n", "        pass\n",
           "a lone surrogate in a string reaches the tokenizer (a 500)",
           "bad input is a 400 naming the field, never a 500"),
    Mutant("server_stop_count_uncapped", CHECKS,
           "len(stops) > MAX_STOP_STRINGS or ", "",
           "any number of stop strings, each checked by the engine thread at every token",
           "no request may stall the others"),
    Mutant("server_length_bound_a_char_a_token", CHECKS,
           "return -(-num_chars // longest)", "return num_chars",
           "the length bound takes a token to be one character: long-token texts refused",
           "the bound before tokenizing is sound"),
    Mutant("server_url_unbounded", LIMITS,
           "if len(self.url) + len(url) > self.limits.max_url_bytes:", "if False:",
           "a long URL is not refused with a 414",
           "HTTP limits: URL (414)"),
    Mutant("server_no_header_timeout", LIMITS,
           "        super().connection_made(transport)\n        self._start_head()\n",
           "        super().connection_made(transport)\n",
           "a connection that sends nothing is kept open forever (slowloris)",
           "HTTP limits: a header timeout"),
    Mutant("server_connections_uncapped", LIMITS,
           "if len(self.connections) >= self.limits.max_connections:", "if False:",
           "connections are accepted until the file descriptors run out",
           "HTTP limits: a cap on open connections"),
    Mutant("server_disconnect_logged", EP + "body_checker.py",
           "except ClientDisconnect:", "except ConnectionAbortedError:",
           "a client that leaves before its body is read logs a traceback",
           "quiet logging of client disconnects"),
    Mutant("server_shutdown_never_expires", LAUNCHER,
           "call_later(self.timeout,", "call_later(self.timeout + 3600,",
           "past --shutdown-timeout uvicorn cancels the handlers: streams cut mid-chunk, 500s",
           "shutdown ends every stream with an error event and [DONE]"),
]


def copy_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked and untracked, not ignored files)."""
    names = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, names):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def ordered(tests: list[str], mutant: Mutant) -> list[str]:
    first = FIRST.get(mutant.file, [])
    return sorted(tests, key=lambda t: t not in first)  # stable: keeps FAST_TESTS' order


def preload() -> None:
    """Import the heavy libraries once, in this process, so that each forked pytest run
    starts warm (importing torch and transformers costs seconds per run, much more on a
    loaded machine). nanoserve itself is NOT imported here: each run imports the copy."""
    import hypothesis  # noqa: F401
    import pytest  # noqa: F401
    import torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoTokenizer, GenerationConfig  # noqa: F401


def run_pytest(tree: Path, tests: list[str], extra: list[str], timeout: float
               ) -> tuple[str, str, float]:
    """Run pytest on `tree` in a forked child. Returns (outcome, first failing test,
    seconds); outcome is "killed" (a failing test, or a crash), "survived", "timeout"
    (counted as killed: a livelock is caught) or "error"."""
    log = tree / ".mutate-pytest.log"
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: run pytest on the copy, its output to the log
        code = 3
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.chdir(tree)
            sys.path.insert(0, str(tree))
            os.environ["NANOSERVE_HYPOTHESIS_PROFILE"] = "mutate"
            import pytest

            import nanoserve
            assert Path(nanoserve.__file__).is_relative_to(tree), nanoserve.__file__
            code = pytest.main([*PYTEST, *extra, *tests])
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(int(code))
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - start > timeout:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout", f"(no result in {timeout:.0f} s)", time.monotonic() - start
        time.sleep(0.1)
    seconds, returncode = time.monotonic() - start, os.waitstatus_to_exitcode(status)
    output = log.read_text(errors="replace")
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
    if returncode == 0:
        return "survived", "", seconds
    if failed:
        return "killed", failed[0], seconds
    if returncode < 0 or "Fatal Python error" in output:  # a C mutant crashed the test run:
        crash = re.findall(r"^Fatal Python error: (.*)$", output, re.MULTILINE)  # CI sees it
        return "killed", f"(pytest crashed: {crash[0] if crash else -returncode})", seconds
    return "error", " / ".join(output.strip().splitlines()[-3:]), seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="only mutants whose name contains one of these")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument("--full", action="store_true",
                        help="run the whole suite (slow tests too) against fast-test survivors")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per pytest run")
    parser.add_argument("--tests", nargs="+", default=FAST_TESTS, metavar="PATH",
                        help="the test files to run (default: the fast ones)")
    args = parser.parse_args()
    mutants = [m for m in MUTANTS if not args.names or any(n in m.name for n in args.names)]
    if args.list:
        for i, m in enumerate(mutants, 1):
            print(f"{i:2d}. {m.name}  ({m.file})\n    breaks: {m.description}\n"
                  f"    rule:   {m.rule}")
        return 0

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"  # a mutant must never run stale bytecode
    sys.dont_write_bytecode = True
    preload()
    with tempfile.TemporaryDirectory(prefix="nanoserve-mutate-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        tests = [t for t in args.tests if (tree / t).is_file()]
        fast = ["-m", "not slow"]
        outcome, detail, secs = run_pytest(tree, tests, fast, args.timeout)
        if outcome != "survived":
            print(f"the fast tests fail without any mutant ({detail}); fix that first")
            return 2
        print(f"fast tests, no mutant: pass in {secs:.0f} s ({', '.join(tests)})\n")
        rows = []
        for i, m in enumerate(mutants, 1):
            path = tree / m.file
            source = path.read_text()
            count = source.count(m.original)
            if m.needs is not None and m.needs not in cpu_flags():
                rows.append((m, "untestable here", f"needs {m.needs}, which this CPU lacks", 0.0))
            elif count != 1:
                why = "snippet not found" if count == 0 else f"snippet found {count} times"
                rows.append((m, "stale", why, 0.0))
            else:
                path.write_text(source.replace(m.original, m.replacement))
                try:
                    outcome, detail, secs = run_pytest(tree, ordered(tests, m), fast,
                                                       args.timeout)
                    if outcome == "survived" and args.full:
                        outcome, detail, more = run_pytest(tree, ["tests"], [], args.timeout)
                        secs += more
                        if outcome in ("killed", "timeout"):
                            outcome, detail = f"{outcome} (full suite)", detail
                finally:
                    path.write_text(source)
                rows.append((m, outcome, detail, secs))
            _, outcome, detail, secs = rows[-1]
            print(f"[{i:2d}/{len(mutants)}] {m.name:34s} {outcome:20s} {secs:5.0f} s  {detail}",
                  flush=True)

    print_table(rows)
    live = [r for r in rows if r[1] not in ("stale", "untestable here")]
    killed_fast = sum(r[1] in ("killed", "timeout") for r in live)
    killed_all = sum(r[1] != "survived" and r[1] != "error" for r in live)
    print(f"\nscore (fast tests): {killed_fast}/{len(live)} killed "
          f"({100 * killed_fast / max(len(live), 1):.0f}%)")
    if args.full:
        print(f"score (whole suite): {killed_all}/{len(live)} killed")
    untestable = [r[0].name for r in rows if r[1] == "untestable here"]
    if untestable:
        print(f"not run (their code cannot run on this CPU): {', '.join(untestable)}")
    stale = [r[0].name for r in rows if r[1] == "stale"]
    if stale:
        print(f"stale (update their snippets): {', '.join(stale)}")
    return 0 if all(r[1] not in ("survived", "error") for r in live) else 1


def print_table(rows: list) -> None:
    print("\n| # | mutant | file | rule | result | killed by |\n|---|---|---|---|---|---|")
    for i, (m, outcome, detail, _) in enumerate(rows, 1):
        print(f"| {i} | {m.name} | {Path(m.file).name} | {m.rule} | {outcome} | "
              f"{detail.replace('|', '/')} |")


if __name__ == "__main__":
    sys.exit(main())
