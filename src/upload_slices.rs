//! How much memory Envoy spends on a request body it holds for the filter, and when to have
//! it hold the body in one piece instead.
//!
//! Envoy reads a connection into 16 KiB slices and, when it buffers a body for a filter,
//! moves each read's slice into the buffer whole: only pieces under 512 bytes are copied into
//! the slice before them. A client that uploads in small writes (1 KiB every few
//! milliseconds, or a slow link's 1,448-byte segments) so makes Envoy hold about 16 KiB per
//! piece: 12 to 32 times the body. Measured with envoy/envoy.yaml in Envoy 1.40: 50 such
//! uploads of 87 MB in all held 1.4 GB, and took Envoy past its heap monitor's threshold,
//! where it answers every other client 503. Written again as one piece (the filter reads the
//! held body and puts the same bytes back), the body takes its own size.

/// The size of the slices Envoy reads a connection into.
const READ_SLICE: usize = 16 * 1024;

/// Pieces smaller than this are copied into the slice before them rather than moved.
const COPIED_BELOW: usize = 512;

/// Bodies smaller than this are left as Envoy holds them (at most 32 times this, 2 MiB, for
/// the smallest pieces moved whole), and most requests stay clear of the work.
const SMALLEST_REWRITTEN: usize = 64 * 1024;

/// How many times its own size Envoy may spend on a body before it is written again. Each
/// rewrite copies the body into the VM and back; at 4, a body uploaded in 1 KiB pieces is
/// rewritten each time it has grown by a quarter, copying about five times its final size
/// in all (ten in 512-byte pieces, the worst).
const MOST_HELD_PER_BYTE: usize = 4;

/// One request body's pieces as they arrive.
#[derive(Debug, Default)]
pub struct UploadSlices {
    /// The body's length at the last piece.
    received: usize,
    /// What Envoy's slices holding it take, as estimated from the pieces' sizes.
    held: usize,
}

impl UploadSlices {
    /// The body held so far has grown to `received` bytes. Whether Envoy's slices now take so
    /// much more than the body that it should be written again in one piece; once it is, the
    /// estimate starts again from the body's own size.
    pub fn grown_to(&mut self, received: usize) -> bool {
        let piece = received.saturating_sub(self.received);
        self.received = received;
        let slices = if piece < COPIED_BELOW {
            piece
        } else {
            piece.div_ceil(READ_SLICE).saturating_mul(READ_SLICE)
        };
        self.held = self.held.saturating_add(slices);
        let rewrite = received >= SMALLEST_REWRITTEN
            && self.held > received.saturating_mul(MOST_HELD_PER_BYTE);
        if rewrite {
            self.held = received;
        }
        rewrite
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How many rewrites a body of `total` bytes uploaded in pieces of `piece` bytes gets.
    fn rewrites(total: usize, piece: usize) -> usize {
        let mut slices = UploadSlices::default();
        (piece..=total)
            .step_by(piece)
            .filter(|&received| slices.grown_to(received))
            .count()
    }

    #[test]
    fn a_body_read_in_large_pieces_is_never_written_again() {
        assert_eq!(rewrites(8 << 20, 64 * 1024), 0);
        assert_eq!(rewrites(8 << 20, 16 * 1024), 0);
        // Pieces that fill most of a slice.
        assert_eq!(rewrites(8 << 20, 5 * 1024), 0);
    }

    #[test]
    fn a_small_body_is_never_written_again_whatever_its_pieces() {
        assert_eq!(rewrites(60 * 1024, 600), 0);
    }

    #[test]
    fn tiny_pieces_are_copied_by_envoy_and_need_no_rewrite() {
        assert_eq!(rewrites(8 << 20, 100), 0);
    }

    #[test]
    fn small_pieces_get_a_bounded_number_of_rewrites() {
        // 1 KiB pieces: each rewrite once the body has grown by about a quarter.
        let kib = rewrites(8 << 20, 1024);
        assert!((15..=30).contains(&kib), "{kib} rewrites");
        // Pieces just over Envoy's copy threshold are the worst case.
        let worst = rewrites(8 << 20, 512);
        assert!(worst > kib && worst <= 60, "{worst} rewrites");
    }

    #[test]
    fn the_estimate_between_rewrites_stays_within_the_bound() {
        let mut slices = UploadSlices::default();
        let mut received = 0;
        while received < 4 << 20 {
            received += 600;
            slices.grown_to(received);
            if received >= SMALLEST_REWRITTEN {
                let bound = received * MOST_HELD_PER_BYTE + READ_SLICE;
                assert!(slices.held <= bound, "{} held for {received}", slices.held);
            }
        }
    }

    #[test]
    fn a_body_that_shrinks_or_stays_counts_nothing_new() {
        let mut slices = UploadSlices::default();
        assert!(!slices.grown_to(1 << 20));
        let held = slices.held;
        assert!(!slices.grown_to(1 << 20));
        assert!(!slices.grown_to(0));
        assert_eq!(slices.held, held);
    }
}
