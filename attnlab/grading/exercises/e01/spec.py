"""The references of exercise 01_soft_alignment: what the grader compares the learner's answers with.

Never shown in the exercise; hidden (stand-ins that raise) in a kernel that ``attnlab grade`` runs.
"""


import torch

def additive_scores(s, h, w, u, v):
    """Alignment scores e_j = v^T tanh(W s + U h_j).

    s: (B, Dq) decoder state; h: (B, N, Dk) encoder states;
    w: (A, Dq), u: (A, Dk), v: (A,).  Returns (B, N).
    """
    ws = s @ w.T  # (B, A)
    uh = h @ u.T  # (B, N, A)
    return torch.tanh(ws[:, None, :] + uh) @ v  # (B, N)


def context_vector(scores, h, mask=None):
    """Softmax the scores over the N source positions and average the encoder states.

    scores: (B, N); h: (B, N, Dk); mask: bool (B, N), True = real token, or None.
    Returns (context (B, Dk), weights (B, N)). A row with no real token gets zero weights.
    """
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)  # (B, 1), the row max
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(scores - m)  # (B, N), masked positions are exp(-inf) = 0
    total = e.sum(dim=-1, keepdim=True)  # (B, 1)
    weights = torch.where(total > 0, e / total.clamp_min(1e-30), torch.zeros_like(e))
    context = (weights[:, :, None] * h).sum(dim=1)  # (B, Dk)
    return context, weights


def decode_step(s, h, w, u, v, w_s, w_c, mask=None):
    """One step of an attention decoder: attend with the current state, then update it.

    s: (B, Dq); h: (B, N, Dk); w, u, v as in ``additive_scores``;
    w_s: (Dq, Dq), w_c: (Dq, Dk); mask: bool (B, N) or None.
    Returns (new state (B, Dq) = tanh(s W_s^T + c W_c^T), weights (B, N)).
    """
    scores = additive_scores(s, h, w, u, v)  # (B, N)
    c, weights = context_vector(scores, h, mask)  # (B, Dk), (B, N)
    s_new = torch.tanh(s @ w_s.T + c @ w_c.T)  # (B, Dq)
    return s_new, weights


__import__("attnlab.grading.hiding", fromlist=["hide"]).hide(globals())
