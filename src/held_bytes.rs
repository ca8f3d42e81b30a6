//! A budget for what the filter holds in its wasm VM across callbacks. Envoy's heap monitor
//! and overload actions cannot see the VM's memory, and an allocation the VM cannot make
//! traps and kills it for every request on the worker; so the few things a request keeps in
//! the VM beyond one callback (a whole body while prefill works, prefill's prompt logprobs
//! until they are in decode's answer) are counted here, and a request that would go past the
//! budget is refused instead.

use std::cell::Cell;
use std::rc::Rc;

/// A reservation up to this size is small: what an ordinary request keeps (its headers for a
/// KV release, its request id, the head of its body), as against a whole body or prompt
/// logprobs.
const SMALL_RESERVATION: usize = 16 * 1024;

/// The bytes held in one VM (one per Envoy worker), shared by its requests.
#[derive(Clone, Debug)]
pub struct HeldBytes {
    held: Rc<Cell<usize>>,
    limit: usize,
    /// How far large reservations may fill the budget: the rest is kept for small ones.
    large_limit: usize,
}

impl HeldBytes {
    pub fn new(limit: usize) -> HeldBytes {
        HeldBytes {
            held: Rc::new(Cell::new(0)),
            limit,
            large_limit: limit,
        }
    }

    /// A budget whose last quarter only small reservations may take, as far as one large
    /// reservation of `largest` bytes still fits: a client that fills the VM with prompt
    /// logprobs its decodes keep waiting must not get every other request refused.
    pub fn with_room_for_small(limit: usize, largest: usize) -> HeldBytes {
        let room = (limit / 4).min(limit.saturating_sub(largest));
        HeldBytes {
            large_limit: limit - room,
            ..HeldBytes::new(limit)
        }
    }

    /// This budget over the bytes `other` counts: the VM's other roots (listeners with
    /// another configuration, a configuration being replaced) hold bytes in the same VM.
    pub fn counting_with(self, other: &HeldBytes) -> HeldBytes {
        HeldBytes {
            held: Rc::clone(&other.held),
            ..self
        }
    }

    /// Room for `bytes` more, given back when the reservation is dropped; `None` when the
    /// budget has no such room.
    pub fn reserve(&self, bytes: usize) -> Option<Reservation> {
        self.take(bytes, bytes).then(|| Reservation {
            held: Rc::clone(&self.held),
            bytes,
        })
    }

    /// Grows `reservation`, one of this budget's, by `bytes`, within the limit a reservation
    /// of its new size has; `false`, and the reservation as it was, when there is no room.
    pub fn grow(&self, reservation: &mut Reservation, bytes: usize) -> bool {
        let Some(size) = reservation.bytes.checked_add(bytes) else {
            return false;
        };
        let taken = self.take(bytes, size);
        if taken {
            reservation.bytes = size;
        }
        taken
    }

    /// Counts `bytes` more for a reservation that then holds `size`, within the limit a
    /// holding of that size has; `false`, and nothing counted, when there is no room.
    fn take(&self, bytes: usize, size: usize) -> bool {
        let limit = if size > SMALL_RESERVATION {
            self.large_limit
        } else {
            self.limit
        };
        match self.held.get().checked_add(bytes) {
            Some(total) if total <= limit => {
                self.held.set(total);
                true
            }
            _ => false,
        }
    }

    pub fn held(&self) -> usize {
        self.held.get()
    }

    pub fn limit(&self) -> usize {
        self.limit
    }
}

/// Bytes counted against a [`HeldBytes`] budget for as long as this lives.
#[derive(Debug)]
pub struct Reservation {
    held: Rc<Cell<usize>>,
    bytes: usize,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.held.set(self.held.get().saturating_sub(self.bytes));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_of_one_vm_count_each_others_bytes() {
        let vm = HeldBytes::new(0);
        let old = HeldBytes::new(10).counting_with(&vm);
        let new = HeldBytes::new(10).counting_with(&vm);
        let held = old.reserve(7).unwrap();
        assert!(new.reserve(4).is_none(), "the VM holds 7 of 10 already");
        assert_eq!(new.held(), 7);
        drop(held);
        assert!(new.reserve(10).is_some());
    }

    #[test]
    fn reservations_count_until_dropped() {
        let budget = HeldBytes::new(10);
        let first = budget.reserve(6).unwrap();
        assert!(budget.reserve(5).is_none(), "past the limit");
        let second = budget.reserve(4).unwrap();
        assert_eq!(budget.held(), 10);
        drop(first);
        assert_eq!(budget.held(), 4);
        assert!(budget.reserve(6).is_some());
        drop(second);
        assert_eq!(budget.held(), 0);
        assert!(budget.reserve(usize::MAX).is_none());
        assert!(HeldBytes::new(usize::MAX).reserve(usize::MAX).is_some());
    }

    #[test]
    fn a_grown_reservation_counts_at_its_new_size() {
        let budget = HeldBytes::with_room_for_small(64 * 1024, 32 * 1024);
        let mut held = budget.reserve(10).unwrap();
        assert!(budget.grow(&mut held, 20));
        assert_eq!(budget.held(), 30);
        // Past 16 KiB it is a large holding: three quarters of the budget at most.
        assert!(!budget.grow(&mut held, 48 * 1024));
        assert_eq!(budget.held(), 30, "unchanged when refused");
        assert!(budget.grow(&mut held, 40 * 1024));
        assert!(!budget.grow(&mut held, usize::MAX));
        drop(held);
        assert_eq!(budget.held(), 0, "all of it given back");
    }

    #[test]
    fn large_reservations_leave_the_last_quarter_to_small_ones() {
        const MIB: usize = 1 << 20;
        let budget = HeldBytes::with_room_for_small(16 * MIB, 4 * MIB);
        let large: Vec<Reservation> = (0..3).map(|_| budget.reserve(4 * MIB).unwrap()).collect();
        assert!(budget.reserve(SMALL_RESERVATION + 1).is_none(), "at 12 MiB");
        let small: Vec<Reservation> = (0..256)
            .map(|_| budget.reserve(SMALL_RESERVATION).unwrap())
            .collect();
        assert_eq!(budget.held(), 16 * MIB);
        assert!(budget.reserve(1).is_none(), "full");
        drop(small);
        drop(large);
        assert_eq!(budget.held(), 0);
        // One reservation of the largest size fits however small the budget is.
        let tight = HeldBytes::with_room_for_small(6 * MIB, 5 * MIB);
        let _largest = tight.reserve(5 * MIB).unwrap();
        assert!(tight.reserve(2 * MIB).is_none());
        assert!(tight.reserve(SMALL_RESERVATION).is_some());
        // A budget of one largest body keeps no room aside; none keeps nothing.
        let equal = HeldBytes::with_room_for_small(4 * MIB, 4 * MIB);
        assert!(equal.reserve(4 * MIB).is_some());
        let none = HeldBytes::with_room_for_small(0, 0);
        assert!(none.reserve(1).is_none());
        assert!(none.reserve(0).is_some());
    }
}
