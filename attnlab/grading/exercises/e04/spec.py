"""The references of exercise 04_multi_head: what the grader compares the learner's answers with.

Never shown in the exercise; hidden (stand-ins that raise) in a kernel that ``attnlab grade`` runs.
"""

from attnlab.grading.exercises.e02.spec import causal_mask, masked_attention

def split_heads(x, num_heads):
    """(B, N, d_model) -> (B, h, N, d_model / h): head i holds features [i*dh, (i+1)*dh)."""
    b, n, d_model = x.shape
    d_head = d_model // num_heads
    return x.view(b, n, num_heads, d_head).transpose(1, 2)  # (B, h, N, dh)


def merge_heads(x):
    """(B, h, N, dh) -> (B, N, h*dh), the inverse of ``split_heads``."""
    b, h, n, dh = x.shape
    return x.transpose(1, 2).reshape(b, n, h * dh)  # (B, N, d_model)


def multi_head_attention(x, w_q, w_k, w_v, w_o, num_heads, causal=False):
    """Multi-head self-attention without biases (nn.Linear convention: y = x W^T).

    x: (B, N, d_model); w_q, w_k, w_v, w_o: (d_model, d_model).
    Returns (B, N, d_model).
    """
    q = split_heads(x @ w_q.T, num_heads)  # (B, h, N, dh)
    k = split_heads(x @ w_k.T, num_heads)
    v = split_heads(x @ w_v.T, num_heads)
    n = x.shape[1]
    mask = causal_mask(n, n, device=x.device) if causal else None
    heads = masked_attention(q, k, v, mask)  # (B, h, N, dh), scaled by 1/sqrt(dh)
    return merge_heads(heads) @ w_o.T  # (B, N, d_model)


__import__("attnlab.grading.hiding", fromlist=["hide"]).hide(globals())
