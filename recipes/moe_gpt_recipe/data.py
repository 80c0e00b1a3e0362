"""The recipe's data: token sequences drawn from two random successor tables (a bigram and a skip-bigram), made
once per run and replayed for every mode."""
import torch


def _successor_table(args, g, device="cuda"):
    """[vocab, vocab] next-token distributions: 4 likely successors per row (0.55 / 0.25 / 0.15 / 0.05), 2% uniform."""
    succ = torch.randint(0, args.vocab, (args.vocab, 4), generator=g, device=device)
    weights = torch.tensor([0.55, 0.25, 0.15, 0.05], device=device).expand(args.vocab, 4)
    table = torch.zeros(args.vocab, args.vocab, device=device).scatter_add_(1, succ, weights)
    return 0.98 * table + 0.02 / args.vocab


def chain_batches(args, rank):
    """All micro-batches of the run, `[steps * micro_batches, batch, seq_len + 1]` token ids. Each next token is
    drawn, by a fair coin, from the row of the token before it in one random table (a bigram) or from the row of
    the token two before in another (a skip-bigram), so the model learns fast at first and then has to learn to
    attend one position further back. The tables are alike on every rank, the draws are per rank; made once and
    replayed for every mode. Returns (batches, the loss floor: the entropy of the next token given the two before,
    0.5 A[a] + 0.5 B[b], averaged over the run's own (a, b) pairs, in nats). On the CPU with --cpu."""
    device = "cpu" if args.cpu else "cuda"
    g = torch.Generator(device=device).manual_seed(args.seed)
    near, far = _successor_table(args, g, device), _successor_table(args, g, device)
    g.manual_seed(args.seed * 1000 + 1 + rank)
    n = args.steps * args.micro_batches * args.micro_batch_size
    tok = torch.randint(0, args.vocab, (n, args.seq_len + 1), generator=g, device=device)
    for t in range(2, args.seq_len + 1):  # all sequences advance together: seq_len launches in all
        coin = torch.rand(n, 1, generator=g, device=device) < 0.5
        rows = torch.where(coin, near[tok[:, t - 1]], far[tok[:, t - 2]])
        tok[:, t] = torch.multinomial(rows, 1, generator=g).squeeze(1)
    a, b = tok[:64, 1:-1].flatten(), tok[:64, :-2].flatten()
    p = 0.5 * near[a] + 0.5 * far[b]
    floor = float(-(p * p.log()).sum(1).mean())
    return tok.view(args.steps * args.micro_batches, args.micro_batch_size, args.seq_len + 1), floor


def replay(batches):
    pos = torch.arange(batches.shape[2] - 1, device=batches.device).expand(batches.shape[1], -1)
    for tok in batches:
        yield {"tokens": tok[:, :-1].contiguous(), "labels": tok[:, 1:].contiguous(), "position_ids": pos}


def data_iterators(models, batches):
    """The schedule's data: one iterator, or one per chunk (Megatron's interleaved schedule reads a chunk's own)."""
    return replay(batches) if len(models) == 1 else [replay(batches) for _ in models]
