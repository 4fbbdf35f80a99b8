"""A stage's backward cut in two, as zero-bubble pipeline schedules run it: the
input-gradient part (B), which the previous stage waits for, and the weight-gradient
part (W), which nothing waits for and so can fill the stage's idle time.

jax.vjp cannot give the parts apart without recomputation: asked for the input
gradient alone it drops the weight products, but the weight gradient of an early
layer needs the gradients flowing back through every later one. So the stage's
function is run by a small jaxpr interpreter that finds every equation mixing a
weight-side value (computed from the parameters alone, such as a weight or its
bf16 cast) with an activation-side one (computed from the stage input or the batch):
the matmuls against weights, the norms' scales, an embedding lookup. B is the vjp
with respect to the stage input and to a "tap" on each such equation's output, whose
cotangent is that output's gradient dy_i: it yields dx and every dy_i, and runs none
of the weight products. W takes each equation's activation inputs a_i (kept from the
forward) and dy_i and runs only the weight products: the vjp, with respect to the
parameters, of the equations evaluated on a_i. A stage holds a micro-batch's a_i from its
forward to its W, B's residuals from the forward to B (activation-side values only: the
weight-side ones, a layer's slice of the stacked weights or its bf16 cast, are computed
again in B, as a remat policy would, rather than kept per micro-batch), and its dy_i from
B to W.

Inside the interpreter the stage's nested programs (jit, remat, the layers' scan) are
written out, so the parts are the stage's arithmetic with no loop: `config.model.remat`
does not apply inside a split stage, and compiling takes longer as a stage holds more
layers (an island's stage programs otherwise scan them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core

from hetjax.errors import ConfigError

_CONST, _WEIGHT, _ACT = 0, 1, 2  # what a value depends on: nothing, the parameters only, the input
_INLINED = ("jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint")
# Mixing equations whose weight gradient reads only the output gradient (a bias): W needs
# none of their activation inputs.
_ADDITIVE = ("add", "sub", "add_any")
_SAVED = "hetjax_split_activation"  # B keeps only values so named: the activation side


@jax.custom_vjp
def _tap(y, t):
    """y, with t's cotangent equal to y's: how B reads an equation's output gradient."""
    del t
    return y


_tap.defvjp(lambda y, t: (y, None), lambda _, ct: (ct, ct))


def _float(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


class _Run:
    """One interpretation of the stage's jaxpr. mode: "shapes" (record each mixing
    equation's output avals and activation inputs), "input" (B: tap the outputs, keep the
    activation inputs) or "weight" (W: only the weight side and the mixing equations,
    on saved activation inputs)."""

    def __init__(self, mode, taps=None, acts=None, uses=None):
        self.mode, self.taps, self.acts = mode, taps, acts
        self.count = 0  # mixing equations met so far, in program order
        self.outs = []  # mode "weight": each mixing equation's outputs
        self.saved = {}  # modes "input" and "shapes": id of a kept activation value -> its index
        self.saved_values = []
        # per mixing equation: (invar position, activation index) of its activation inputs
        self.uses = [] if uses is None else uses
        self.out_avals = []  # per mixing equation: its outputs' avals

    def eval(self, jaxpr, consts, args):
        """args: (value, kind) per invar; returns the same per outvar."""
        env = {}

        def read(v):
            return (v.val, _CONST) if isinstance(v, core.Literal) else env[v]

        for v, c in zip(jaxpr.constvars, consts):
            env[v] = (c, _CONST)
        for v, a in zip(jaxpr.invars, args):
            env[v] = a
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            outs = self.equation(eqn, ins)
            for v, o in zip(eqn.outvars, outs):
                env[v] = o
        return [read(v) for v in jaxpr.outvars]

    def equation(self, eqn, ins):
        kinds = [k for _, k in ins]
        kind = max(kinds, default=_CONST)
        name = eqn.primitive.name
        if name in _INLINED:
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            consts = inner.consts if isinstance(inner, core.ClosedJaxpr) else ()
            return self.eval(getattr(inner, "jaxpr", inner), consts, ins)
        if name == "scan" and kind == _ACT:
            return self.scan(eqn, ins)
        mixing = _WEIGHT in kinds and _ACT in kinds
        if self.mode == "weight" and kind == _ACT and not mixing:
            return [(None, _ACT)] * len(eqn.outvars)  # activation side: B computed it
        if mixing and self.mode == "weight":
            vals = [v for v, _ in ins]
            for pos, index in self.uses[self.count]:
                aval = eqn.invars[pos].aval
                vals[pos] = jnp.zeros(aval.shape, aval.dtype) if index is None else self.acts[index]
            ins = [(v, k) for v, k in zip(vals, kinds)]
        if mixing and name.startswith("custom"):
            raise ConfigError(
                f"config.pipeline.split_backward=True: the stage has a {name} equation that takes weights and "
                f"activations together, and its own gradient rule cannot be cut in two; set split_backward=False")
        with eqn.ctx.manager:
            outs = eqn.primitive.bind(*[v for v, _ in ins], **eqn.primitive.get_bind_params(eqn.params))
        outs = list(outs) if eqn.primitive.multiple_results else [outs]
        if mixing:
            outs = self.mixing(eqn, ins, outs)
        if self.mode == "input" and kind == _ACT:
            outs = [checkpoint_name(o, _SAVED) if _float(v.aval) else o for o, v in zip(outs, eqn.outvars)]
        return [(o, kind) for o in outs]

    def mixing(self, eqn, ins, outs):
        i = self.count
        self.count += 1
        if self.mode == "weight":
            self.outs.append([o for o, v in zip(outs, eqn.outvars) if _float(v.aval)])
            return outs
        uses = []  # an activation used by several equations (q, k and v's input) is kept once
        for pos, (value, kind) in enumerate(ins):
            if kind == _ACT and eqn.primitive.name in _ADDITIVE:
                uses.append((pos, None))  # W reads zeros there: the weight's gradient does not use it
            elif kind == _ACT:
                if id(value) not in self.saved:
                    self.saved[id(value)] = len(self.saved_values)
                    self.saved_values.append(value)
                uses.append((pos, self.saved[id(value)]))
        if self.mode == "shapes":
            self.uses.append(uses)
            self.out_avals.append([v.aval for v in eqn.outvars if _float(v.aval)])
            return outs
        taps = iter(self.taps[i])
        return [_tap(o, next(taps)) if _float(v.aval) else o for o, v in zip(outs, eqn.outvars)]

    def scan(self, eqn, ins):
        """A scan over activations, written out (the layers' scan)."""
        p = eqn.params
        nc, ncarry, length = p["num_consts"], p["num_carry"], p["length"]
        consts, carry, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
        body = p["jaxpr"]
        ys = []
        for t in (reversed(range(length)) if p["reverse"] else range(length)):
            x_t = [(None if v is None else v[t], k) for v, k in xs]
            outs = self.eval(body.jaxpr, body.consts, consts + carry + x_t)
            carry, y = outs[:ncarry], outs[ncarry:]
            ys.append(y)
        if p["reverse"]:
            ys.reverse()
        stacked = []
        for j in range(len(eqn.outvars) - ncarry):
            vals, kinds = [y[j][0] for y in ys], {y[j][1] for y in ys}
            if {_WEIGHT, _ACT} <= kinds:  # the stacking would mix them with no tap to see it
                raise ConfigError(
                    "config.pipeline.split_backward=True: the stage scans a value that starts from the weights "
                    "alone (a learned initial state) and stacks it with activations; the split cannot cut "
                    "there; set split_backward=False")
            kind = max(kinds, default=_CONST)  # zeros first, activations after: activation-side
            stacked.append((None if any(v is None for v in vals) else jnp.stack(vals), kind))
        return carry + stacked


class Split:
    """fn(params, x, batch) -> y with its backward in two parts. Build it from abstract
    (or real) arguments; then, inside a program, `forward` gives y and what the parts
    read, `input_grads` B's dx and output gradients, `weight_grads` W's gradients.
    x may be None (a first stage, which embeds the batch)."""

    def __init__(self, fn, params, x, batch):
        self.closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(params, x, batch)
        self.out_tree = jax.tree.structure(out_shape)
        run = _Run("shapes")

        def shapes(params, x, batch):
            outs = run.eval(self.closed.jaxpr, self.closed.consts, self._args(params, x, batch))
            # hetjax's stages return activations; a weight-only output would get no gradient from W
            assert all(k != _WEIGHT for _, k in outs), "an output of the stage is computed from weights alone"
            return [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in run.saved_values]
        self.act_avals = jax.eval_shape(shapes, params, x, batch)
        self.uses, self.tap_avals = run.uses, run.out_avals

    def _args(self, params, x, batch):
        out = []
        for tree, kind in ((params, _WEIGHT), (x, _ACT), (batch, _ACT)):
            out += [(leaf, kind) for leaf in jax.tree.leaves(tree)]
        return out

    def _input_side(self, params, x, batch, taps):
        run = _Run("input", taps=taps)
        outs = run.eval(self.closed.jaxpr, self.closed.consts, self._args(params, x, batch))
        y = jax.tree.unflatten(self.out_tree, [v for v, _ in outs])
        assert len(run.saved_values) == len(self.act_avals)
        return y, run.saved_values

    def forward(self, params, x, batch):
        """(y, vjp, activation inputs): vjp(dy) is B (`input_grads`); the activation
        inputs are W's, to keep until it runs."""
        taps = [[jnp.zeros(a.shape, a.dtype) for a in avals] for avals in self.tap_avals]
        # B keeps only activation-side values: a layer's weights, sliced from the stack or
        # cast, would otherwise be a residual of every micro-batch in flight.
        side = jax.checkpoint(lambda x, taps: self._input_side(params, x, batch, taps),
                              policy=jax.checkpoint_policies.save_only_these_names(_SAVED))
        return jax.vjp(side, x, taps, has_aux=True)

    @staticmethod
    def input_grads(vjp, dy):
        """B: (dx, output gradients of the mixing equations) from forward's vjp."""
        return vjp(dy)

    def weight_grads(self, params, acts, dys):
        """W: the parameters' gradients from the activation inputs and output gradients."""
        def mixing_outputs(params):
            run = _Run("weight", acts=acts, uses=self.uses)
            args = self._args(params, None, None)
            args += [(None, _ACT)] * (len(self.closed.jaxpr.invars) - len(args))  # B had x and the batch
            run.eval(self.closed.jaxpr, self.closed.consts, args)
            return run.outs
        _, vjp = jax.vjp(mixing_outputs, params)
        return vjp(dys)[0]
