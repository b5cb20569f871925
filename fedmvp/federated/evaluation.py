"""The paper's evaluation (docs/method.md §7): Local / Base / New / HM (+ held-out domains) of a model.

``evaluate_global`` scores the global model (or the frozen CLIP, zero-shot, with the same
attribute classifier) on a task context; ``evaluate_run`` does it for a round of a run
directory, rebuilding the model from the run's method record; ``format_table`` prints the
paper's two-row table.
"""

from __future__ import annotations

import torch

from fedmvp.data.federation_plan import is_open
from fedmvp.federated.metrics import SITE_COUNT_KEYS, Counts, combine_counts, counted, evaluation_sites
from fedmvp.federated.populations import compare_populations, population_lines
from fedmvp.federated.privacy_budget import round_privacy
from fedmvp.federated.task import Samples, TaskContext, task_context
from fedmvp.model import autocast_for
from fedmvp.runs import RunDir, RunError

COLUMNS = ("local", "base", "new", "hm")
ROW_KEYS = (*COLUMNS, "domain", *SITE_COUNT_KEYS)  # a row's metrics and how many sites each is a mean over


@torch.no_grad()
def accuracy(ctx: TaskContext, key: str, samples: Samples, text_features: torch.Tensor,
             prompted: bool = True, batch_size: int = 256) -> tuple[int, int]:
    """(correct, total) of the global model (or the frozen CLIP when ``prompted`` is False)."""
    model = ctx.model
    images, labels = ctx.images(key, samples)
    model.set_text_features(text_features)
    model.eval()
    correct = 0
    for start in range(0, len(images), batch_size):
        batch = images[start:start + batch_size].to(ctx.device)
        with autocast_for(ctx.device):
            feats = model.encode(batch) if prompted else model.encode_frozen(batch)
            logits = model.logits(feats.float())
        correct += int((logits.argmax(-1).cpu() == labels[start:start + batch_size]).sum())
    return correct, len(images)


def site_counts(ctx: TaskContext, site: int, global_state: dict[str, torch.Tensor] | None,
                assignment: dict[str, int]) -> Counts:
    """What one site evaluates on its own data: its Local test set and the sets assigned to it.

    ``global_state`` None evaluates the frozen CLIP (zero-shot) with the same classifier."""
    prompted = global_state is not None
    if prompted:
        ctx.model.load_state(global_state)
        ctx.model.set_lora_mode(False)
    counts: Counts = {}
    client = ctx.client(site)
    feats = ctx.text_features(client.class_names, client.attributes, client.style)
    counts["local"] = accuracy(ctx, f"test/{client.client_id}", client.test, feats, prompted)
    for ev in ctx.federation.evaluations:
        if assignment.get(ev.name) == site:
            feats = ctx.text_features(ev.class_names, ev.attributes, ev.style)
            counts[ev.name] = accuracy(ctx, f"eval/{ev.kind}/{ev.dataset}/{ev.domain}", ev.samples, feats, prompted)
    return counts


def federation_counts(ctx: TaskContext, global_state: dict[str, torch.Tensor] | None) -> dict[int, Counts]:
    """Every site of ``ctx``'s federation evaluated here, each as its node would (``site_counts``): the
    whole federation (a simulation's data), or one site's part (a site's folder, ``folder_evaluation``)."""
    assignment = evaluation_sites(ctx.federation.record())
    return {c.client_id: site_counts(ctx, c.client_id, global_state, assignment) for c in ctx.federation.clients}


def evaluate_global(ctx: TaskContext, global_state: dict[str, torch.Tensor] | None) -> dict[str, float | None]:
    """The paper's metrics of the global model (or zero-shot CLIP), every site evaluated here."""
    return combine_counts(ctx.federation.record(), federation_counts(ctx, global_state))


def not_evaluated(run: RunDir, round_number: int, source: str | None = None) -> str:
    """Why an open federation's round without recorded metrics cannot be evaluated here (one line);
    ``source`` "ingest": a round `fedmvp ingest` wrote, which no site ever evaluates."""
    from fedmvp.federated.ingest import SOURCE as INGESTED  # here: a site's ClientApp imports this module

    how = "was written by fedmvp ingest, which evaluates nothing" if source == INGESTED else \
        "was not evaluated when it ran"
    later = "" if source == INGESTED else ", or let the sites evaluate rounds as they run (fedmvp serve --eval-every N)"
    return (f"{run.path}: round {round_number} {how}, and its data is not here: an open federation's sites hold "
            f"it. Evaluate the round on one site's folder (fedmvp evaluate --run {run.path} --round {round_number} "
            f"--data DIR){later}")


def current_record(run: RunDir) -> dict:
    """The federation's record as its sites are numbered now: an open federation's grows as sites join
    (RUN/sites.json, docs/architecture.md "Open membership"); a listed one's is the run's record."""
    preset = run.preset()
    if not is_open(preset):
        return run.federation_record()
    from fedmvp.data.federation_plan import plan_record
    from fedmvp.federated.site_registry import SiteRegistry, SiteRegistryError

    try:
        run_id = str(run.read_config().get("run_id", run.path.name))
        return plan_record(preset, SiteRegistry.load(run.path, run_id).names)
    except SiteRegistryError:
        return run.federation_record()  # sites it does not number are then not paired (compare_populations)


def evaluate_run(run: RunDir, round_number: int | None = None) -> dict:
    """Zero-shot (frozen CLIP, same attribute classifier) and tuned metrics of one round.

    An open federation's server holds no site data (docs/architecture.md "Open membership"): its rounds'
    metrics are what the sites reported; a round they did not evaluate is a `RunError` (``not_evaluated``),
    and a zero-shot row never recorded shows as not measured. Both rows are over the same sites: where
    a site did not evaluate the round, zero-shot is taken again over the sites that did
    (``populations.compare_populations``)."""
    config = run.read_config()
    checkpoint = run.load_checkpoint(round_number)
    privacy = round_privacy(run, checkpoint.round)  # [privacy]: what its weights spent; a bad record before any work
    zero_shot = run.read_zero_shot()
    tuned = checkpoint.state.get("metrics", {})
    if zero_shot is None or tuned.get("hm") is None:
        if is_open(run.preset()):
            if "hm" not in tuned:  # an evaluated round records hm (None where no site held a set)
                raise RunError(not_evaluated(run, checkpoint.round, checkpoint.state.get("source")))
            zero_shot = zero_shot or {}
        else:
            ctx = task_context(run.preset_file(config), run.method(checkpoint), config.get("server_device", "cpu"))
            record = ctx.federation.record()
            if zero_shot is None:
                zero_shot = counted(record, federation_counts(ctx, None))
                run.write_zero_shot(zero_shot)
            if tuned.get("hm") is None:
                tuned = counted(record, federation_counts(ctx, checkpoint.tensors))
    result = {"run": str(run.path), "round": checkpoint.round,  # a key not recorded: None
              **compare_populations(current_record(run), zero_shot, tuned, ROW_KEYS)}
    return result if privacy is None else {**result, "privacy": privacy}


def format_table(result: dict) -> str:
    """Rows zero-shot / tuned, columns Local, Base, New, HM (percent), then the held-out domain."""
    has_domain = any(result[row].get("domain") is not None for row in ("zero-shot", "tuned"))
    header = f"{'':<10} {'Local':>7} {'Base':>7} {'New':>7} {'HM':>7}" + (f" {'Domain':>8}" if has_domain else "")
    site = result.get("site")  # one site's folder (folder_evaluation): where the figures come from
    where = "" if site is None else f", on site {site['name']}'s folder {site['data']}"
    lines = [f"round {result['round']} of {result['run']}{where}", header]
    for row in ("zero-shot", "tuned"):
        values = result[row]
        cells = " ".join(f"{100 * values[k]:7.2f}" if values.get(k) is not None else f"{'-':>7}" for k in COLUMNS)
        if has_domain:
            d = values.get("domain")
            cells += f" {100 * d:8.2f}" if d is not None else f" {'-':>8}"
        lines.append(f"{row:<10} {cells}")
    lines += population_lines(result)
    if site is not None:
        images = ", ".join(f"{kind} {n}" for kind, n in site["images"].items())
        lines.append(f"held-out images: {images}")
    privacy = result.get("privacy")
    if privacy is not None:
        lines.append(privacy_line(privacy))
    return "\n".join(lines)


def privacy_line(privacy: dict) -> str:
    """The ``privacy:`` line: epsilon over the rounds that added noise, or plainly that none did, and how
    many rounds were not private (docs/howto/privacy.md); a key an older record lacks is not shown."""
    settings = f"({privacy.get('mode')}, noise_multiplier {privacy.get('noise_multiplier')}, clip_norm " \
               f"{privacy.get('clip_norm')})"
    if privacy.get("epsilon") is None:
        line = f"privacy: not differentially private: no round up to this one added noise {settings}"
    else:
        line = (f"privacy: epsilon {privacy['epsilon']:.3g} at delta {privacy.get('delta')} over "
                f"{privacy.get('dp_rounds')} rounds {settings}")
    unnoised = privacy.get("not_private_rounds") or 0
    return line + (f"; {unnoised} rounds not private (their sites trained the PromptFormer)" if unnoised else "")
