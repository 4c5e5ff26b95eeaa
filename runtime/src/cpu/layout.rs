//! Strided indexing, the one place that knows how row-major tensors are laid out: strides,
//! numpy broadcasting as stride 0, and a walk over a shape that yields the element offsets
//! of several strided operands at once (used by broadcasting, transposes, slices, expands,
//! tiles and reductions).

/// Row-major strides of a contiguous tensor of `shape`.
pub fn strides_of(shape: &[usize]) -> Vec<isize> {
    let mut s = vec![0isize; shape.len()];
    let mut acc = 1isize;
    for i in (0..shape.len()).rev() {
        s[i] = acc;
        acc *= shape[i] as isize;
    }
    s
}

/// Strides that read a contiguous tensor of `in_shape` as if it had `out_shape` (numpy
/// broadcasting: dims are right-aligned, missing and size-1 dims get stride 0). The caller
/// guarantees that `in_shape` broadcasts to `out_shape`.
pub fn broadcast_strides(in_shape: &[usize], out_shape: &[usize]) -> Vec<isize> {
    let own = strides_of(in_shape);
    let lead = out_shape.len() - in_shape.len();
    (0..out_shape.len())
        .map(|i| {
            if i < lead || in_shape[i - lead] == 1 {
                0
            } else {
                own[i - lead]
            }
        })
        .collect()
}

/// Number of elements of a shape, or `None` on overflow.
pub fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
}

/// Calls `f(offsets, len, steps)` once per innermost row of `shape`, in row-major order:
/// the row's elements are at `offsets[k] + j * steps[k]` for `j < len` in operand `k`.
/// `base` is each operand's offset of position 0. Size-1 dims are dropped and adjacent dims
/// that are contiguous for every operand merged, so rows are as long as the layout allows.
pub fn walk_rows<const N: usize>(
    shape: &[usize],
    strides: [&[isize]; N],
    base: [isize; N],
    mut f: impl FnMut([isize; N], usize, [isize; N]),
) {
    if shape.contains(&0) {
        return;
    }
    // (size, strides per operand), size-1 dims dropped, contiguous neighbours merged
    let mut dims: Vec<(usize, [isize; N])> = Vec::with_capacity(shape.len());
    for (d, &size) in shape.iter().enumerate() {
        if size == 1 {
            continue;
        }
        let s: [isize; N] = std::array::from_fn(|k| strides[k][d]);
        if let Some(last) = dims.last_mut() {
            if (0..N).all(|k| last.1[k] == s[k] * size as isize) {
                last.0 *= size;
                last.1 = s;
                continue;
            }
        }
        dims.push((size, s));
    }
    let Some(&(inner_n, inner_s)) = dims.last() else {
        f(base, 1, [0; N]);
        return;
    };
    let outer = &dims[..dims.len() - 1];
    let mut idx = vec![0usize; outer.len()];
    let mut off = base;
    loop {
        f(off, inner_n, inner_s);
        let mut d = outer.len();
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            let (size, st) = outer[d];
            for (x, s) in off.iter_mut().zip(st) {
                *x += s;
            }
            if idx[d] < size {
                break;
            }
            for (x, s) in off.iter_mut().zip(st) {
                *x -= s * size as isize;
            }
            idx[d] = 0;
        }
    }
}

/// Calls `f` with the offsets into N strided operands of every position of `shape`, in
/// row-major order of `shape` (see [`walk_rows`]).
pub fn walk<const N: usize>(
    shape: &[usize],
    strides: [&[isize]; N],
    base: [isize; N],
    mut f: impl FnMut([isize; N]),
) {
    walk_rows(shape, strides, base, |mut o, len, step| {
        for _ in 0..len {
            f(o);
            for (x, s) in o.iter_mut().zip(step) {
                *x += s;
            }
        }
    });
}

/// Copies the elements of a strided view of `src` (shape `shape`, `strides`, offset `base`)
/// into a new contiguous vector.
pub fn gather_strided<T: Copy>(
    src: &[T],
    shape: &[usize],
    strides: &[isize],
    base: isize,
) -> Vec<T> {
    let n: usize = shape.iter().product();
    if base == 0 && n == src.len() && strides == strides_of(shape).as_slice() {
        return src.to_vec();
    }
    let mut out = Vec::with_capacity(n);
    walk_rows(shape, [strides], [base], |[o], len, [step]| {
        let o = o as usize;
        match step {
            1 => out.extend_from_slice(&src[o..o + len]),
            0 => out.extend(std::iter::repeat_n(src[o], len)),
            _ => out.extend((0..len as isize).map(|j| src[(o as isize + j * step) as usize])),
        }
    });
    out
}

/// Broadcasts `src` of `in_shape` to `out_shape` (numpy rules, checked by the caller).
pub fn expand<T: Copy>(src: &[T], in_shape: &[usize], out_shape: &[usize]) -> Vec<T> {
    gather_strided(src, out_shape, &broadcast_strides(in_shape, out_shape), 0)
}

/// `f(a, b)` elementwise with numpy broadcasting of `a` (shape `sa`) and `b` (shape `sb`) to
/// `out`. Equal shapes and scalar operands take a straight loop.
pub fn zip_broadcast<A: Copy, B: Copy, R>(
    a: &[A],
    sa: &[usize],
    b: &[B],
    sb: &[usize],
    out: &[usize],
    f: impl Fn(A, B) -> R,
) -> Vec<R> {
    let n: usize = out.iter().product();
    if a.len() == n && b.len() == n && sa == sb {
        return a.iter().zip(b).map(|(&x, &y)| f(x, y)).collect();
    }
    if b.len() == 1 && a.len() == n {
        let y = b[0];
        return a.iter().map(|&x| f(x, y)).collect();
    }
    if a.len() == 1 && b.len() == n {
        let x = a[0];
        return b.iter().map(|&y| f(x, y)).collect();
    }
    let (ta, tb) = (broadcast_strides(sa, out), broadcast_strides(sb, out));
    let mut v = Vec::with_capacity(n);
    // broadcast strides are 0 or the contiguous stride, so a row steps by 0 or 1
    walk_rows(out, [&ta, &tb], [0, 0], |[i, j], len, step| {
        let (i, j) = (i as usize, j as usize);
        match step {
            [1, 1] => v.extend(
                a[i..i + len]
                    .iter()
                    .zip(&b[j..j + len])
                    .map(|(&x, &y)| f(x, y)),
            ),
            [1, 0] => {
                let y = b[j];
                v.extend(a[i..i + len].iter().map(|&x| f(x, y)))
            }
            [0, 1] => {
                let x = a[i];
                v.extend(b[j..j + len].iter().map(|&y| f(x, y)))
            }
            _ => {
                let (sa, sb) = (step[0] as usize, step[1] as usize);
                v.extend((0..len).map(|t| f(a[i + t * sa], b[j + t * sb])))
            }
        }
    });
    v
}

/// Three-operand broadcasting (for Where).
pub fn zip3_broadcast<A: Copy, B: Copy, C: Copy, R>(
    a: (&[A], &[usize]),
    b: (&[B], &[usize]),
    c: (&[C], &[usize]),
    out: &[usize],
    f: impl Fn(A, B, C) -> R,
) -> Vec<R> {
    let n: usize = out.iter().product();
    if a.1 == out && b.1 == out && c.1 == out {
        return (0..n).map(|i| f(a.0[i], b.0[i], c.0[i])).collect();
    }
    let ta = broadcast_strides(a.1, out);
    let tb = broadcast_strides(b.1, out);
    let tc = broadcast_strides(c.1, out);
    let mut v = Vec::with_capacity(n);
    // broadcast strides are 0 or the contiguous stride, so a row steps by 0 or 1; the
    // common rows (the first operand fixed along the row) get their own loops
    walk_rows(out, [&ta, &tb, &tc], [0, 0, 0], |[i, j, k], len, step| {
        let (i, j, k) = (i as usize, j as usize, k as usize);
        match step {
            [0, 1, 1] => {
                let x = a.0[i];
                v.extend(
                    b.0[j..j + len]
                        .iter()
                        .zip(&c.0[k..k + len])
                        .map(|(&y, &z)| f(x, y, z)),
                )
            }
            [0, 0, 1] => {
                let (x, y) = (a.0[i], b.0[j]);
                v.extend(c.0[k..k + len].iter().map(|&z| f(x, y, z)))
            }
            [0, 1, 0] => {
                let (x, z) = (a.0[i], c.0[k]);
                v.extend(b.0[j..j + len].iter().map(|&y| f(x, y, z)))
            }
            _ => {
                let [si, sj, sk] = step.map(|s| s as usize);
                v.extend((0..len).map(|t| f(a.0[i + t * si], b.0[j + t * sj], c.0[k + t * sk])))
            }
        }
    });
    v
}

/// Splits `shape` around `axis` into (outer, dim, inner) element counts.
pub fn around_axis(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (
        shape[..axis].iter().product(),
        shape[axis],
        shape[axis + 1..].iter().product(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walk_transposed_and_broadcast() {
        // [2,3] transposed to [3,2]
        let src = [0, 1, 2, 3, 4, 5];
        let t = gather_strided(&src, &[3, 2], &[1, 3], 0);
        assert_eq!(t, vec![0, 3, 1, 4, 2, 5]);
        let e = expand(&[1, 2, 3], &[3], &[2, 3]);
        assert_eq!(e, vec![1, 2, 3, 1, 2, 3]);
        let e = expand(&[1, 2], &[2, 1], &[2, 3]);
        assert_eq!(e, vec![1, 1, 1, 2, 2, 2]);
        // negative stride
        let r = gather_strided(&src, &[6], &[-1], 5);
        assert_eq!(r, vec![5, 4, 3, 2, 1, 0]);
        // scalar shape and empty shapes
        assert_eq!(gather_strided(&[7], &[], &[], 0), vec![7]);
        assert!(gather_strided::<i32>(&[], &[0, 3], &[3, 1], 0).is_empty());
    }

    #[test]
    fn zip_general_broadcast() {
        let a = [1, 2]; // [2,1]
        let b = [10, 20, 30]; // [3]
        let r = zip_broadcast(&a, &[2, 1], &b, &[3], &[2, 3], |x, y| x + y);
        assert_eq!(r, vec![11, 21, 31, 12, 22, 32]);
    }
}
