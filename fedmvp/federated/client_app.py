"""The FedMVP ClientApp: a round of local training, and evaluation on this site's own data.

The client id comes from the node's config (``partition-id``, set by the simulation engine or by
``flower-supernode --node-config "partition-id=3"``); the preset (a shipped preset's name, else the
TOML path on the server's machine), the run's method record (what model to build) and the round's
settings come in the server's message (its schema: ``fedmvp_formats.messages``). A SuperNode whose
preset file lives elsewhere names it itself: ``--node-config "partition-id=3 preset='/data/site3.toml'"``.
A node is asked once who it is (``identify``: its identity, from its node config alone) and then
sent work only in the rounds its site is sampled for (fedmvp.federated.sampling). Its torch
threads: the node config's ``threads`` (a SuperNode's own machine), else the message's (the
simulation's share of one machine for each node), else torch's default."""

from __future__ import annotations

from dataclasses import replace

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedmvp_formats import messages as schema
from fedmvp_formats.messages import Identity, Instruction
from fedmvp_formats.names import LORA_PREFIX
from fedmvp_formats.privacy import PrivacyRecord, privatise
from fedmvp_formats.shown import name_shown

from fedmvp.data.federation import SiteRequest
from fedmvp.data.federation_plan import is_open
from fedmvp.data.site_federation import site_id
from fedmvp.data.site_folder import SiteFolderError
from fedmvp.federated.evaluation import site_counts
from fedmvp.federated.site_classes import FROM_SERVER, ClassSetMismatch, SiteClasses, site_classes
from fedmvp.federated.site_keys import AUTH_KEY, NONCE, PROOF, PROOF_REQUEST, payload, sign
from fedmvp.presets.schema import load_preset
from fedmvp.federated.task import LocalSettings, local_train, task_context, train_class_counts
from fedmvp.federated.wire import (content_instruction, content_records, content_torch_state, records_content,
                                  state_records, to_numpy_state)
from fedmvp.model import FedMVPConfig

app = ClientApp()


def _threads(context: Context, instruction: Instruction) -> None:
    """Torch's CPU threads for this node: its node config's ``threads``, else the server's message's."""
    threads = int(context.node_config.get(schema.THREADS, instruction.threads or 0))
    if threads > 0 and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def _site(context: Context, preset: str, instruction: Instruction, identify: bool = False
          ) -> tuple[int, str | None, SiteRequest]:
    """This node's site id, its name (a [federation] site) and what of the data it builds: a paper
    preset's partition (``partition-id``), or a named site's own folder (``site-name``, ``data``). A named
    site's id is its place among [[sites]]; in an open federation (no [[sites]]) the id the server gave
    its name, which each message to it carries (``site-id``; an identify before that: ``UNNUMBERED``)."""
    config = context.node_config
    if schema.SITE_NAME in config:
        name = str(config[schema.SITE_NAME])
        parsed = load_preset(preset, check_roots=False)
        if is_open(parsed):
            number = instruction.site if identify else instruction.need("site")  # train, evaluate: numbered
            site = schema.UNNUMBERED if number is None else number
        else:
            number, site = None, site_id(parsed, name)
        fraction = config.get("eval-fraction")
        request = SiteRequest(name=name, data=str(config.get("data", "")), site=number,
                              eval_fraction=None if fraction is None else float(fraction))
        return site, name, request
    if "partition-id" not in config:
        raise RuntimeError("this SuperNode has no partition-id: start it with `fedmvp join --site N` "
                           "(or flower-supernode --node-config \"partition-id=N\"; N: its site, 0-based)")
    site = int(config["partition-id"])
    if "num-partitions" in config:  # the simulation engine's node: every site's data on this machine,
        parsed = load_preset(preset, check_roots=False)  # one federation built once per worker
        named = parsed.federation is not None and site < len(parsed.sites)  # a [[sites]] simulation
        return site, parsed.sites[site].name if named else None, None  # its name, as a deployed site's
    return site, None, SiteRequest(site=site)


def _classes(context: Context, preset: str, instruction: Instruction) -> SiteClasses:
    """The run's class set this site uses: its own attribute file's once it is the run's, or the one the
    message carries where the node took it from the server (`fedmvp join --classes-from-server`)."""
    return site_classes(preset, instruction, from_server=context.node_config.get(FROM_SERVER) is True)


def _context(preset: str, instruction: Instruction, request: SiteRequest | None, classes: SiteClasses):
    """The task context of this site's data, built with the class set it uses. A folder whose classes do not
    fit a class set taken from the server (which the join, holding none, could not check) is one line."""
    method = FedMVPConfig.from_dict(instruction.need("method"), "the server's method record")
    if request is not None and classes.attributes is not None:
        request = replace(request, attributes=classes.attributes)
    try:
        return task_context(preset, method, _device(instruction.device), request)
    except SiteFolderError as err:
        if classes.attributes is None:  # the join checked this folder against the site's own file
            raise
        more = f" (and {len(err.problems) - 1} more problems)" if len(err.problems) > 1 else ""
        raise ClassSetMismatch(f"refused before training: this site's folder does not fit the class set of run "
                               f"{name_shown(instruction.run_id)}: {err.problems[0]}{more}") from None


def _device(device: str | None) -> str:
    device = device or "cpu"
    return "cpu" if device == "cuda" and not torch.cuda.is_available() else device


def _reply(msg: Message, identity: Identity, metrics: dict, state: dict[str, torch.Tensor] | None = None,
           classes: dict[str, int] | None = None) -> Message:
    records = {schema.METRICS: metrics, schema.IDENTITY: identity.record()}
    if classes is not None:  # a train reply: its training images per class (the server records them)
        records[schema.CLASSES] = classes
    if state is not None:  # packed: .npy bytes and their layout (fedmvp.federated.wire)
        records = {**state_records(to_numpy_state(state)), **records}
    return Message(content=records_content(records), reply_to=msg)


@app.query(schema.IDENTIFY)
def identify(msg: Message, context: Context) -> Message:
    """Who this node is (its site, and its name where sites are named): the server sends a site's
    work only to its node. Nothing is loaded but the preset (a named site's id is its place in it)."""
    instruction = content_instruction(msg.content)
    client_id, name, _ = _site(context, str(context.node_config.get("preset", instruction.need("preset"))),
                               instruction, identify=True)
    identity = Identity(round=instruction.round, run_id=instruction.run_id, site=client_id, name=name)
    return _reply_identity(msg, identity, proof(msg, context, identity))


def _reply_identity(msg: Message, identity: Identity, extra: dict | None = None) -> Message:
    return Message(content=records_content({schema.IDENTITY: {**identity.record(), **(extra or {})}}), reply_to=msg)


def proof(msg: Message, context: Context, identity: Identity) -> dict:
    """A named site's proof that it holds its SuperNode's key (the node config's ``auth-key``), for the
    server's nonce: a site bound to a key is sent work only with it (fedmvp.federated.site_keys)."""
    request, key_file = content_records(msg.content).get(PROOF_REQUEST), context.node_config.get(AUTH_KEY)
    if request is None or not key_file or identity.name is None or not isinstance(request.get(NONCE), str):
        return {}
    data = payload(identity.run_id, identity.round, msg.metadata.dst_node_id, identity.name, request[NONCE])
    return {PROOF: sign(str(key_file), data)}


@app.train()
def train(msg: Message, context: Context) -> Message:
    instruction = content_instruction(msg.content)
    _threads(context, instruction)
    preset = str(context.node_config.get("preset", instruction.need("preset")))
    client_id, name, request = _site(context, preset, instruction)
    classes = _classes(context, preset, instruction)  # another class set than the run's: refused before training
    # Which site, run, round and class set this reply belongs to: the server checks it before using the reply.
    identity = Identity(round=instruction.round, run_id=instruction.run_id, site=client_id, name=name,
                        classes_digest=classes.digest)
    ctx = _context(preset, instruction, request, classes)
    client = ctx.client(client_id)
    lora_active = client_id in instruction.need("lora-clients")
    received = content_torch_state(msg.content)
    result = local_train(ctx, client, received, instruction.round,
                         instruction.need("lr"), lora_active, LocalSettings.from_record(instruction.need("local")))
    if instruction.privacy is not None and result.lora_active:  # [privacy]: the LoRA delta clipped (local: noised)
        result.state = private_lora(result.state, received, instruction.privacy)
    metrics = schema.train_metrics(result.num_examples, result.loss, ce=result.ce, consistency=result.consistency,
                                   lora_active=result.lora_active, switch_next=result.switch_next)
    return _reply(msg, identity, metrics, result.state, train_class_counts(client))


def private_lora(state: dict[str, torch.Tensor], received: dict[str, torch.Tensor], record: dict
                 ) -> dict[str, torch.Tensor]:
    """A LoRA-only reply under the run's ``[privacy]``: its delta against the round's LoRA clipped to
    ``clip_norm`` and, in local mode, noised, as a device does (``fedmvp_formats.privacy.privatise``)."""
    settings = PrivacyRecord.from_record(record, "the server's privacy record")
    lora = {k: v.detach().cpu().numpy() for k, v in state.items() if k.startswith(LORA_PREFIX)}
    sent, _ = privatise(lora, {k: received[k].detach().cpu().numpy() for k in lora}, settings)
    return {**state, **{k: torch.from_numpy(v) for k, v in sent.items()}}


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Federated evaluation (docs/method.md §7): this site's Local test set and the evaluation sets
    assigned to it, on its own data; only the counts go back."""
    instruction = content_instruction(msg.content)
    _threads(context, instruction)
    preset = str(context.node_config.get("preset", instruction.need("preset")))
    client_id, name, request = _site(context, preset, instruction)
    classes = _classes(context, preset, instruction)
    identity = Identity(round=instruction.round, run_id=instruction.run_id, site=client_id, name=name,
                        classes_digest=classes.digest)
    ctx = _context(preset, instruction, request, classes)
    state = content_torch_state(msg.content) if instruction.prompted else None
    counts = site_counts(ctx, client_id, state, instruction.need("assignment"))
    return _reply(msg, identity, schema.count_metrics(counts))
